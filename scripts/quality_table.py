"""The README's quality table, on demand: each placement of a checkpoint exported, then scored by
composite.eval against the float model (--reference eager) on real text.

    python scripts/quality_table.py --checkpoint checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text /usr/share/common-licenses/GPL-3 [--ctx 512] [--limit-tokens 2048] \\
        [--qnn-limit-tokens 512] [--rows fp32,8da8w,...] [--workdir DIR]

Every row is one `composite.export` (printed) and one `composite.eval --reference eager --score
second-half` (llama.cpp's convention, so the figures compare with llama-perplexity's). Exports go
through the shard cache, so rows that share shards re-lower only what differs. QNN rows run on the
x86 HTP simulator, slowly: they score the text's first --qnn-limit-tokens tokens. Prints a markdown
table; --workdir keeps the exports (default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
XNNPACK = ["--shards", "3"]
# The main job's placement: XNNPACK ends, four QNN shards of two layers (configs/smollm2.yaml).
QNN = ["--config", "configs/smollm2.yaml", "--no-weight-sharing"]
TORCHAO = ["--head-quantize", "same", "--weight-mapping", "symmetric"]  # torchao's own choices
Q8 = [*XNNPACK, "--quantize", "8da8w"]
Q4 = [*XNNPACK, "--quantize", "8da4w", "--group-size", "32"]
Q4_128 = [*XNNPACK, "--quantize", "8da4w", "--group-size", "128"]
ROWS = {
    "fp32": ("XNNPACK fp32, 3 shards", XNNPACK),
    "fp16": ("XNNPACK fp16", [*XNNPACK, "--dtype", "fp16"]),
    "8da8w-torchao": ("XNNPACK 8da8w, torchao's symmetric scales", [*Q8, *TORCHAO]),
    "8da8w": ("XNNPACK 8da8w (defaults: unclipped scales)", Q8),
    "8da8w-emb8": ("XNNPACK 8da8w, embedding 8,0", [*Q8, "--embedding-quantize", "8,0"]),
    "8da4w-torchao": ("XNNPACK 8da4w g32, torchao's choices (4-bit head, symmetric)", [*Q4, *TORCHAO]),
    "8da4w-head8": ("XNNPACK 8da4w g32, 8-bit head, symmetric", [*Q4, "--weight-mapping", "symmetric"]),
    "8da4w": ("XNNPACK 8da4w g32 (defaults: 8-bit head, unclipped scales)", Q4),
    "8da4w-emb4": ("XNNPACK 8da4w g32, embedding 4,32", [*Q4, "--embedding-quantize", "4,32"]),
    "8da4w-emb8": ("XNNPACK 8da4w g32, embedding 8,0", [*Q4, "--embedding-quantize", "8,0"]),
    "8da4w-g128": ("XNNPACK 8da4w g128", Q4_128),
    "8da4w-g128-emb4": ("XNNPACK 8da4w g128, embedding 4,32", [*Q4_128, "--embedding-quantize", "4,32"]),
    "qnn-fp16": ("QNN fp16 (8 layers, simulator), XNNPACK fp32 ends", QNN),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--limit-tokens", type=int, default=2048)
    p.add_argument("--qnn-limit-tokens", type=int, default=512)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma separated, of {', '.join(ROWS)}")
    p.add_argument("--workdir", help="keep the exports here")
    args = p.parse_args(argv)
    unknown = [row for row in args.rows.split(",") if row not in ROWS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; rows are {', '.join(ROWS)}")
    return args


def run(command: list[str]) -> str:
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr}")
    return done.stdout


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        print("| placement | size MB | tokens | PPL | mean KLD | KLD p99 | top-1 | RMS Δp |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in args.rows.split(","):
            label, flags = ROWS[row]
            folder = workdir / row
            export = ["-m", "composite.export", *flags, "--checkpoint", args.checkpoint]
            run([*export, "--max-seq-len", str(args.ctx), "--output", str(folder)])
            limit = args.qnn_limit_tokens if row.startswith("qnn") else args.limit_tokens
            evaluate = ["-m", "composite.eval", "--artifacts", str(folder), "--text", args.text]
            evaluate += ["--ctx", str(args.ctx), "--limit-tokens", str(limit), "--score", "second-half"]
            result = json.loads(run([*evaluate, "--reference", "eager", "--json"]))
            manifest = json.loads((folder / "manifest.json").read_text())
            size = sum(shard["size"] for shard in manifest["shards"]) / 1e6
            print(
                f"| {label} | {size:.1f} | {result['tokens']} | {result['perplexity']:.3f} | {result['kld_mean']:.4f} "
                f"| {result['kld_p99']:.4f} | {100 * result['top1_agreement']:.1f}% | {100 * result['rms_dp']:.2f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
