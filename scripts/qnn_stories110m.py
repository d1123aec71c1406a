"""On demand (not CI): the stories110M shape on the HTP simulator, QNN in the middle.

Exports the benchmark's random-weight stories110M checkpoint (768 dim, 12 layers, 12 heads,
vocab 32000) in 6 shards: xnnpack, 4 x qnn 16a4w (SM8650, 3 layers each), xnnpack, with native
(uint16) cache and hidden-state I/O. The QNN shards are exported as the host twin (no weight
sharing), which this machine can run; --weight-sharing also exports the device form, for its sizes.
Then generates with composite.run and, when built, composite_runner, and prints each shard's size
and SQNR and the KV-cache bytes the runners hold, against float32.
Usage: python scripts/qnn_stories110m.py [--work DIR] [--max-seq-len 256] [--weight-sharing]
Run after `eval "$(python -m composite.qnn_host env)"` for composite_runner."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from composite.bench.workload import DIMS, write_workload
from composite.config import build_config
from composite.export import run_export
from composite.manifest import memory_figures

REPO = Path(__file__).resolve().parent.parent
PLACEMENT = ["xnnpack", "qnn", "qnn", "qnn", "qnn", "xnnpack"]
LAYERS = [0, 3, 3, 3, 3, 0]


def export(paths: dict, out: Path, max_seq_len: int, weight_sharing: bool) -> tuple[dict, float]:
    started = time.perf_counter()
    if not (out / "manifest.json").exists():
        values = {
            "checkpoint": str(paths["consolidated.00.pth"]),
            "params": str(paths["params.json"]),
            "tokenizer": str(paths["tokenizer.model"]),
            "shards": len(PLACEMENT),
            "layers_per_shard": LAYERS,
            "placement": PLACEMENT,
            "qnn": {"soc": "SM8650", "precision": "16a4w", "weight_sharing": weight_sharing},
            "max_seq_len": max_seq_len,
            "prefill_len": 32,
            "output": str(out),
        }
        run_export(build_config(None, values))
    return json.loads((out / "manifest.json").read_text()), time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(Path.home() / ".cache/composite/qnn_stories110m"))
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--weight-sharing", action="store_true", help="also export the weight-shared device form")
    args = p.parse_args()
    work = Path(args.work)
    paths = write_workload(DIMS["stories110m"], work / "checkpoint")
    twin_dir = work / f"twin_{args.max_seq_len}"
    twin, seconds = export(paths, twin_dir, args.max_seq_len, weight_sharing=False)
    print(f"export (host twin): {seconds:.0f} s")
    shared = None
    if args.weight_sharing:
        shared, seconds = export(paths, work / f"shared_{args.max_seq_len}", args.max_seq_len, weight_sharing=True)
        print(f"export (weight-shared): {seconds:.0f} s")

    figures = memory_figures(twin)
    model = twin["model"]
    float32_layer = 4 * 2 * model["n_kv_heads"] * model["head_dim"] * twin["max_seq_len"]
    print("shard  backend     size (twin)  size (shared)  SQNR hidden decode/prefill dB  KV bytes (float32)")
    for i, shard in enumerate(twin["shards"]):
        sqnr = shard.get("sqnr_db")
        sqnr_text = f"{sqnr['decode']['hidden']:.1f}/{sqnr['prefill']['hidden']:.1f}" if sqnr else "-"
        shared_size = f"{shared['shards'][i]['size'] / 1e6:.1f} MB" if shared else "-"
        layers = shard["layers"][1] - shard["layers"][0]
        print(
            f"{i:<6} {shard['placement']['backend']:<11} {shard['size'] / 1e6:>8.1f} MB  {shared_size:>13}  "
            f"{sqnr_text:>29}  {figures['kv_cache_bytes_per_shard'][i]:>9} ({layers * float32_layer})"
        )
    total = float32_layer * model["n_layers"]
    print(f"KV cache: {figures['kv_cache_bytes']} bytes, {figures['kv_cache_bytes'] / total:.2f}x of float32 ({total})")

    prompt = ["--prompt", "Once upon a time", "--max-new-tokens", "32", "--json"]
    python = subprocess.run(
        [sys.executable, "-m", "composite.run", "--artifacts", str(twin_dir), *prompt],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    python_stats = json.loads(python.stdout)
    print(f"composite.run: decode {python_stats['decode_tokens_per_s']:.1f} tok/s on the simulator")
    runner = REPO / "build" / "composite_runner"
    if runner.exists():
        stats = work / "stats.json"
        cpp = subprocess.run(
            [str(runner), "--artifacts", str(twin_dir), "--prompt", "Once upon a time", "--max_new_tokens", "32"]
            + ["--stats_json", str(stats)],
            capture_output=True,
            text=True,
        )
        if cpp.returncode != 0:
            print(cpp.stderr, file=sys.stderr)
            sys.exit(1)
        cpp_stats = json.loads(stats.read_text())
        print(
            f"composite_runner: decode {cpp_stats['decode_tokens_per_s']:.1f} tok/s on the simulator; "
            f"KV cache {cpp_stats['kv_cache_bytes']} bytes; "
            f"same tokens as composite.run: {cpp_stats['tokens'] == python_stats['tokens']}"
        )


if __name__ == "__main__":
    main()
