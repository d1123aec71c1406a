"""The seed's model sizes on this machine, on demand (never in CI): Llama-3.2-shaped checkpoints
with seeded random weights exported, run, and set beside llama.cpp's Q4_0 of the same weights.

    python scripts/scale_probe.py                      # 1B and 3B XNNPACK, the 3B hybrid, llama.cpp
    python scripts/scale_probe.py --shapes 1b --recipes xnnpack --rounds 3
    python scripts/scale_probe.py --shapes 3b --recipes hybrid --cached   # resumes a killed run (--work/cache)
    python scripts/scale_probe.py --shapes 3b --recipes hybrid --max-memory 16   # two QNN jobs at once

For each shape it writes the checkpoint once (composite/bench/shapes.py: a Hugging Face folder,
bf16, 2.5 / 6.4 GB) under --work, then:
- exports it with the recipe of the scale issue (the 1B: 4 x XNNPACK 8da4w + embedding 8,0, the
  tied table stored once for the lookup and the 8-bit head; the 3B: 6 x the same, and
  configs/llama3_2_3b_hybrid.yaml as it is, within
  --max-memory, 8 GB unless told), timing the export and sampling the summed PSS of its processes itself
  (composite/memory.py);
- runs composite_runner on the XNNPACK exports: a 55-token prompt and 32 new tokens, greedy;
- converts the checkpoint with llama.cpp's convert_hf_to_gguf.py and llama-quantize Q4_0 (its
  default mix: the tied table as Q6_K) and runs llama-bench on the same prompt and token counts,
  the two runners' rounds interleaved.
Prints one markdown table and writes --work/scale_probe-SHAPES-RECIPES.json. QNN shards of the hybrid export run
on the x86 HTP simulator only when measured by the export itself (its SQNR); their speed here says
nothing about a phone, so the hybrid is exported, not benchmarked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from composite.bench.shapes import config_for, write_checkpoint  # noqa: E402
from composite.manifest_files import stored_bytes  # noqa: E402
from composite.memory import PeakMemory  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 55, 32
RECIPES = {
    "1b": ["--shards", "4", "--quantize", "8da4w", "--embedding-quantize", "8,0", "--max-seq-len", "512"],
    "3b": ["--shards", "6", "--quantize", "8da4w", "--embedding-quantize", "8,0", "--max-seq-len", "512"],
}
# The hybrid as the config has it. Within the scale issue's 8 GB its seven 4-layer QNN 16a4w_block
# jobs (each ~6.3 GB with GPTQ's input moments) run one at a time.
HYBRID = ["--config", str(REPO / "configs" / "llama3_2_3b_hybrid.yaml")]


def checkpoint(work: Path, shape: str) -> Path:
    folder = work / f"llama32-{shape}"
    if not (folder / "config.json").exists():
        print(f"writing the {shape} checkpoint to {folder} ...", file=sys.stderr, flush=True)
        write_checkpoint(folder, config_for(shape))
    return folder


def export(folder: Path, flags: list[str], output: Path, env: dict) -> dict:
    """One export in its own process: its own summary (--json) and the PSS this script sampled."""
    summary = output.with_suffix(".json")
    command = [sys.executable, "-m", "composite.export", "--checkpoint", str(folder), *flags]
    command += ["--output", str(output), "--json", str(summary)]
    started = time.perf_counter()
    with open(output.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        with PeakMemory(root=process.pid) as memory:
            process.wait()
    if process.returncode != 0:
        raise SystemExit(f"the export failed (exit {process.returncode}); see {output.with_suffix('.log')}")
    result = json.loads(summary.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    result["sampled_peak_bytes"] = memory.peak
    result["pte_bytes"] = stored_bytes(result["shards"])
    return result


def run_ours(artifacts: Path, threads: int) -> dict:
    prompt = ",".join(str(1000 + 7 * i) for i in range(PROMPT_TOKENS))
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.json"
        command = [str(REPO / "build" / "composite_runner"), "--artifacts", str(artifacts), "--prompt_ids", prompt]
        command += ["--max_new_tokens", str(NEW_TOKENS), "--stats_json", str(stats), "--threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"composite_runner failed: {done.stderr.strip().splitlines()[-1]}")
        return json.loads(stats.read_text())


def llama_cpp_q4_0(llama_cpp: Path, folder: Path, work: Path) -> Path:
    """The checkpoint as llama.cpp's Q4_0 (default mix). convert_hf_to_gguf.py reads a
    SentencePiece tokenizer here (the embedded default's, padded to the vocabulary): the weights
    are the same files."""
    from composite.model.default import load_default

    gguf = work / f"{folder.name}-Q4_0.gguf"
    if gguf.exists():
        return gguf
    view = work / f"{folder.name}-llama.cpp"
    view.mkdir(exist_ok=True)
    for item in folder.iterdir():
        if item.suffix in (".safetensors", ".json") and not (view / item.name).exists():
            (view / item.name).symlink_to(item)
    (view / "tokenizer.model").write_bytes(load_default().tokenizer_path.read_bytes())
    f16 = work / f"{folder.name}-F16.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "src" / "gguf-py")}
    if not f16.exists():
        subprocess.run(
            [sys.executable, str(llama_cpp / "src" / "convert_hf_to_gguf.py"), str(view), "--outtype", "f16"]
            + ["--outfile", str(f16)],
            check=True,
            env=env,
            capture_output=True,
        )
    started = time.perf_counter()
    subprocess.run(
        [str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(gguf), "Q4_0"],
        check=True,
        capture_output=True,
    )
    print(f"llama-quantize Q4_0 of {folder.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return gguf


def run_llama_cpp(llama_cpp: Path, gguf: Path, threads: int) -> dict:
    from composite.bench.llama_cpp import bench_once

    return bench_once(llama_cpp, gguf, "8da4w", PROMPT_TOKENS, NEW_TOKENS, threads)


def median(values: list[float]) -> float:
    values = sorted(values)
    return (
        values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1b,3b", help="comma separated: 1b, 3b")
    p.add_argument(
        "--work", default=str(Path.home() / ".cache" / "composite" / "scale"), help="checkpoints and outputs"
    )
    p.add_argument("--recipes", default="xnnpack,hybrid", help="comma separated: xnnpack, hybrid (3B only)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--llama-cpp", help="llama.cpp folder (default: what scripts/build_llama_cpp.sh builds)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved runner rounds per shape")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of both runners (default: every core; fewer when something else runs: llama.cpp's "
        "threads wait for each other by spinning, so a busy core slows it far more than ours)",
    )
    p.add_argument("--no-export", action="store_true", help="run the runners on the exports already in --work")
    p.add_argument(
        "--cached",
        action="store_true",
        help="keep each lowered shard in --work/cache, so a run that was stopped resumes (default: lower all)",
    )
    p.add_argument(
        "--max-memory",
        type=float,
        default=8.0,
        help="GB the hybrid export's lowering jobs may hold at once (default 8: the scale issue's goal)",
    )
    args = p.parse_args()
    recipes = set(args.recipes.split(","))
    if not recipes <= {"xnnpack", "hybrid"}:
        raise SystemExit(f"--recipes: xnnpack and/or hybrid, got {args.recipes}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COMPOSITE_CACHE": str(work / "cache") if args.cached else "off"}
    llama_cpp = None
    if not args.no_llama_cpp and "xnnpack" in recipes:
        built = subprocess.run(["bash", str(REPO / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"scripts/build_llama_cpp.sh failed: {built.stderr.strip().splitlines()[-1:]}")
        llama_cpp = Path(args.llama_cpp or built.stdout.strip().splitlines()[-1])
    results = []
    for shape in args.shapes.split(","):
        folder = checkpoint(work, shape)
        if "xnnpack" in recipes:
            results.append(xnnpack_row(shape, folder, work, env, llama_cpp, args))
        if shape == "3b" and "hybrid" in recipes:
            hybrid = export(folder, [*HYBRID, "--max-memory", str(args.max_memory)], work / "export-3b-hybrid", env)
            results.append({"shape": "3b", "recipe": "configs/llama3_2_3b_hybrid.yaml", "export": hybrid})
    (work / f"scale_probe-{args.shapes.replace(',', '-')}-{args.recipes.replace(',', '-')}.json").write_text(
        json.dumps(results, indent=1) + "\n"
    )
    print_table(results)


def xnnpack_row(shape: str, folder: Path, work: Path, env: dict, llama_cpp: Path | None, args) -> dict:
    """The XNNPACK export of `shape`, then our runner and llama.cpp's Q4_0 in interleaved rounds."""
    output = work / f"export-{shape}"
    row = {"shape": shape, "recipe": " ".join(RECIPES[shape]), "threads": args.threads}
    if args.no_export:
        summary = json.loads(output.with_suffix(".json").read_text())
        summary["pte_bytes"] = stored_bytes(summary["shards"])
        summary["wall_seconds"], summary["sampled_peak_bytes"] = summary["seconds"], None
        row["export"] = summary
    else:
        row["export"] = export(folder, RECIPES[shape], output, env)
    if llama_cpp is not None:
        gguf = llama_cpp_q4_0(llama_cpp, folder, work)
        row["gguf_bytes"] = gguf.stat().st_size
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(run_ours(output, args.threads))
        if llama_cpp is not None:
            theirs.append(run_llama_cpp(llama_cpp, gguf, args.threads))
    row["ours"], row["llama_cpp"] = ours, theirs
    return row


def print_table(results: list[dict]) -> None:
    gb = 1e9
    print(
        "| shape | recipe | export | peak PSS | .pte | decode tok/s | prefill tok/s | load s | runner peak RSS "
        "| llama.cpp Q4_0 | its decode / prefill tok/s | decode ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        e = r["export"]
        cells = [
            r["shape"],
            r["recipe"],
            f"{e['wall_seconds'] / 60:.1f} min",
            f"{max(e['peak_bytes'] or 0, e['sampled_peak_bytes'] or 0) / gb:.2f} GB",
            f"{e['pte_bytes'] / 1e6:.0f} MB",
        ]
        if r.get("ours"):
            ours = r["ours"]
            decode = median([o["decode_tokens_per_s"] for o in ours])
            cells += [
                f"{decode:.1f}",
                f"{median([o['prefill_tokens_per_s'] for o in ours]):.1f}",
                f"{median([o['load_ms'] for o in ours]) / 1e3:.1f}",
                f"{max(o['peak_rss_mb'] for o in ours):.0f} MB",
            ]
            theirs = r.get("llama_cpp") or []
            if theirs:
                their_decode = median([t["decode_tokens_per_s"] for t in theirs])
                cells += [
                    f"{r['gguf_bytes'] / 1e6:.0f} MB",
                    f"{their_decode:.1f} / {median([t['prefill_tokens_per_s'] for t in theirs]):.1f}",
                    f"{decode / their_decode:.2f}x",
                ]
            else:
                cells += ["-", "-", "-"]
        else:
            cells += ["-"] * 7
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
