"""On demand: several tokens per call, ours beside llama.cpp's, on the same prompts and weights.

    python scripts/guessing_bench.py --artifacts DIR --gguf F32.gguf --prompts DIR [--llama-cpp DIR]

Each *.txt in --prompts is one user message (one line), chatted in the export's own template.
For each, composite_runner decodes it greedily three ways: plain, --prompt_lookup 3 and
--lookahead 2,3,1 (default sizes, within the verify width 8), and llama.cpp's llama-lookup and
llama-lookahead (their own defaults: 7 guesses from 1..4-grams; W 15, N 5, G 15) decode the same
templated text from an F32 GGUF of the same weights; llama-bench's tg128 gives llama.cpp's plain
decode speed. Printed: tokens generated, tokens per call and decode tok/s per mode, as a markdown
table (docs/benchmark.md, "Several tokens per call"). Two threads each; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "build" / "composite_runner"
OURS = {"plain": [], "prompt lookup": ["--prompt_lookup", "3"], "lookahead": ["--lookahead", "2,3,1"]}


def ours(artifacts: Path, prompt: Path, flags: list[str], max_new: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.json"
        command = [str(RUNNER), "--artifacts", str(artifacts), "--chat", "--threads", "2"]
        command += ["--max_new_tokens", str(max_new), "--stats_json", str(stats), *flags]
        with prompt.open() as stdin:
            subprocess.run(command, stdin=stdin, capture_output=True, check=True)
        return json.loads(stats.read_text())


def templated_text(artifacts: Path, message: str) -> str:
    """The first chat turn as the export's template renders it (its manifest's "chat" pieces), for
    llama.cpp's -p, which parses the special tokens in it."""
    chat = json.loads((artifacts / "manifest.json").read_text())["chat"]
    if "user" in chat["trim"]:
        message = message.strip()
    return chat["first_user_prefix"] + message + chat["user_suffix"]


def llama(binary: Path, gguf: Path, text: str, max_new: int) -> dict:
    command = [str(binary), "-m", str(gguf), "-p", text, "-n", str(max_new), "--temp", "0", "-t", "2", "-c", "1024"]
    log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"n_accept\s+=\s+(\d+)", log)
    if not decoded or not accept:
        raise SystemExit(f"error: cannot read {binary.name}'s summary:\n{log[-2000:]}")
    predicted, accepted = int(decoded.group(1)), int(accept.group(1))
    return {
        "tokens": predicted,
        "tokens_per_call": predicted / max(1, predicted - accepted),
        "tok_s": float(decoded.group(3)),
    }


def llama_plain(bench: Path, gguf: Path, max_new: int) -> float:
    out = subprocess.run(
        [str(bench), "-m", str(gguf), "-p", "0", "-n", str(max_new), "-t", "2", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True, help="an export with a verify method")
    p.add_argument("--gguf", type=Path, required=True, help="the same weights as an F32 GGUF")
    p.add_argument("--prompts", type=Path, required=True, help="a folder of *.txt, one user message each")
    p.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache/composite/llama.cpp")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    rows = []
    llama_tg = llama_plain(bin_dir / "llama-bench", args.gguf, args.max_new_tokens)
    for prompt in sorted(args.prompts.glob("*.txt")):
        runs = {mode: ours(args.artifacts, prompt, flags, args.max_new_tokens) for mode, flags in OURS.items()}
        same = all(r["tokens"] == runs["plain"]["tokens"] for r in runs.values())
        text = templated_text(args.artifacts, prompt.read_text().removesuffix("\n"))
        lookup = llama(bin_dir / "llama-lookup", args.gguf, text, args.max_new_tokens)
        lookahead = llama(bin_dir / "llama-lookahead", args.gguf, text, args.max_new_tokens)
        cells = [prompt.stem, str(len(runs["plain"]["tokens"])), "yes" if same else "NO"]
        cells += [f"{r['tokens_per_call']:.2f} / {r['decode_tokens_per_s']:.1f}" for r in runs.values()]
        cells += [
            f"{lookup['tokens_per_call']:.2f} / {lookup['tok_s']:.1f}",
            f"{lookahead['tokens_per_call']:.2f} / {lookahead['tok_s']:.1f}",
        ]
        rows.append(cells)
        print(" | ".join(cells), file=sys.stderr, flush=True)
    print(f"llama.cpp plain decode (llama-bench tg{args.max_new_tokens}, 2 threads): {llama_tg:.1f} tok/s\n")
    header = ["prompt", "tokens", "same as plain", "ours plain", "ours prompt lookup", "ours lookahead"]
    header += ["llama-lookup", "llama-lookahead"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    print("\n(each cell: tokens per call / decode tok/s)")


if __name__ == "__main__":
    main()
