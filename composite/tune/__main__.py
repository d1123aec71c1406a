"""python -m composite.tune: the placement and precision of every shard, chosen by measured KL
divergence against the float model under a size budget, written as an export config.

    python -m composite.tune --checkpoint X --text FILE --budget-mb N [--shards 6]
        [--candidates qnn:fp16,qnn:16a8w,qnn:16a4w_block,qnn:16a4w,qnn:8a8w,xnnpack:fp32,xnnpack:8da8w,xnnpack:8da4w]
        [--embedding '8,0|4,32|none'] [--head CANDIDATES] [--qnn-block-size 16|32|64] [--rotate auto|none|hadamard|hadamard-ffn] [--ctx N] [--limit-tokens N] [--score all|second-half]
        --output tuned.yaml [--plot tuned.png] [--verify] [--measure-uniform] [--json]

1. Sensitivity: for each group (the embedding, shards - 2 runs of layers, the head) and each choice,
   the KLD with only that group changed, measured in PyTorch (composite/tune/sensitivity.py says
   how each backend is modelled). Results are cached by model weights, text, settings and choice,
   so another budget costs nothing (~/.cache/composite/tune, --cache-dir, --no-cache).
2. Cost: exact stored bytes per group and choice, and the bytes a decode step reads
   (composite/tune/candidates.py).
3. Search: the lowest summed KLD within the budget over every combination (composite/tune/search.py),
   the Pareto frontier as a table and a PNG with the uniform recipes marked.
4. Check: the chosen recipe measured as a whole in PyTorch (how additive the sum was); with
   --verify, exported by composite.export and measured by composite.eval (QNN on the simulator).
With --rotate auto (the export's default) steps 1-4 run with the model not rotated and, where some
candidate has 8-bit weights, rotated as the export's auto rotates such a recipe; the recipe
measured better as a whole is written, with its rotation. This file is the command line; the
steps are composite/tune/steps.py.
"""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    quiet.silence_library_noise()

import argparse
import json
import os
import signal
from pathlib import Path

from composite import qnn_host
from composite.config import ROTATIONS
from composite.errors import UserError, exits_cleanly
from composite.eval.scoring import SCORE_MODES
from composite.executor.fork import ForkedCall
from composite.executor.ray_cluster import from_ray_flag
from composite.placement_options import DEFAULT_OPTIONS, QNN_BLOCK_SIZES
from composite.tune.candidates import DEFAULT_CANDIDATES, DEFAULT_EMBEDDING, parse_candidates
from composite.tune.output import kld_text
from composite.tune.search import thinned
from composite.tune.steps import tune
from composite.units import MB

FRONTIER_ROWS = 16  # the printed frontier; the PNG and --json hold all of it


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.tune", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="Meta .pth, Hugging Face folder or llama GGUF (default: the embedded model)")
    p.add_argument("--params", help="params.json for a Meta checkpoint")
    p.add_argument("--text", required=True, help="a UTF-8 text file to measure on")
    p.add_argument("--budget-mb", type=float, required=True, help="the recipe's weights at most this many MB (1e6 B)")
    p.add_argument("--shards", type=int, default=6, help="embedding + layer groups + head (default 6)")
    p.add_argument("--candidates", default=DEFAULT_CANDIDATES, help=f"comma separated (default {DEFAULT_CANDIDATES})")
    p.add_argument(
        "--embedding", default=DEFAULT_EMBEDDING, help=f"choices for the embedding (default '{DEFAULT_EMBEDDING}')"
    )
    p.add_argument(
        "--head",
        metavar="CANDIDATES",
        help="the head's candidates, comma separated (default: --candidates; e.g. qnn:16a8w fixes it, as "
        "ExecuTorch's Qualcomm llama recipe does)",
    )
    p.add_argument("--group-size", type=int, default=32, help="xnnpack 8da4w weight group (default 32)")
    p.add_argument("--soc", default="SM8650", help="QNN SoC the recipe is for (default SM8650)")
    p.add_argument(
        "--qnn-block-size",
        type=int,
        choices=QNN_BLOCK_SIZES,
        default=DEFAULT_OPTIONS["qnn"]["block_size"],
        help="input channels per block of qnn:16a4w_block weights, measured and exported (default %(default)s)",
    )
    p.add_argument(
        "--rotate",
        choices=["auto", *ROTATIONS],
        default="auto",
        help="measure (and export) the model with its residual stream rotated (hadamard), that and each "
        "feed-forward's hidden activation (hadamard-ffn), or not (none); auto (the export's default): "
        "search without and with the rotation the export's auto gives 8-bit recipes, keep the better",
    )
    p.add_argument("--max-seq-len", type=int, default=512, help="the export's KV cache length (default 512)")
    p.add_argument("--prefill-len", type=int, default=64, help="the export's prefill width (default 64)")
    p.add_argument("--ctx", type=int, help="tokens per chunk (default: --max-seq-len)")
    p.add_argument("--limit-tokens", type=int, default=2048, help="use the text's first N tokens (default 2048)")
    p.add_argument("--score", choices=SCORE_MODES, default="all", help="tokens scored per chunk (default all)")
    p.add_argument("--output", required=True, help="the tuned export config (YAML) to write")
    p.add_argument("--plot", help="the frontier's PNG (default: --output with .png)")
    p.add_argument("--artifacts", help="the export folder the config names (default artifacts/<output's stem>)")
    p.add_argument("--cache-dir", help="where measured sensitivities are kept (default ~/.cache/composite/tune)")
    p.add_argument("--no-cache", action="store_true", help="measure everything again and keep nothing")
    p.add_argument(
        "--measure-uniform",
        nargs="?",
        const="all",
        metavar="CANDIDATES",
        help="also measure the uniform recipes as a whole: all of them, or those of these candidates "
        "(comma separated; each with every --embedding choice)",
    )
    p.add_argument("--verify", action="store_true", help="export the tuned config and measure it with composite.eval")
    p.add_argument("--verify-output", help="keep the verification export here (default: a temporary folder)")
    p.add_argument(
        "--verify-limit-tokens",
        type=int,
        help="--verify measures the text's first N tokens, whole chunks of --ctx (default --limit-tokens; "
        "QNN shards on the simulator evaluate about a token a second)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="measure each (layer group, candidate) as a task on an existing Ray cluster (ADDRESS, else "
        "RAY_ADDRESS, else the one running here); the same YAML as a local run",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def check_args(args) -> None:
    if args.budget_mb <= 0:
        raise UserError(f"--budget-mb must be positive, got {args.budget_mb}")
    if args.group_size < 0:
        raise UserError(f"--group-size must be 0 (per channel) or positive, got {args.group_size}")
    if args.limit_tokens is not None and args.limit_tokens < 2:
        raise UserError(f"--limit-tokens must be at least 2, got {args.limit_tokens}")
    ctx = args.ctx or args.max_seq_len
    if ctx > args.max_seq_len:
        raise UserError(f"--ctx {ctx} is larger than --max-seq-len {args.max_seq_len}")
    if args.verify_limit_tokens is not None:
        if not args.verify:
            raise UserError("--verify-limit-tokens is for --verify")
        if args.verify_limit_tokens < ctx:
            raise UserError(f"--verify-limit-tokens {args.verify_limit_tokens} is less than one chunk (--ctx {ctx})")
        if args.limit_tokens is not None and args.verify_limit_tokens > args.limit_tokens:
            raise UserError(
                f"--verify-limit-tokens {args.verify_limit_tokens} is more than --limit-tokens {args.limit_tokens}"
            )
    if not args.output.endswith((".yaml", ".yml")):
        raise UserError(f"--output {args.output} should be a .yaml file (it is an export config)")
    if Path(args.output).is_dir():
        raise UserError(f"--output {args.output} is a folder; give the YAML file to write")
    plot = Path(args.plot or Path(args.output).with_suffix(".png"))
    if plot.suffix.lower() != ".png":
        raise UserError(f"--plot {plot} should be a .png file")


def report(result: dict, budget_mb: float) -> None:
    print("sensitivity (KLD against the float model with only that group changed):")
    names = list(dict.fromkeys(name for g in result["groups"] for name in g["choices"]))
    print("| group | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for g in result["groups"]:
        cells = [
            f"{kld_text(g['choices'][n]['kld'])} ({g['choices'][n]['mb']:.2f} MB)" if n in g["choices"] else ""
            for n in names
        ]
        print(f"| {g['group']} | " + " | ".join(cells) + " |")
    print("\nPareto frontier (predicted):")
    print("| MB | predicted KLD | recipe (embedding | layer groups | head) |")
    print("|---:|---:|---|")
    for row in thinned(result["frontier"], FRONTIER_ROWS):
        print(f"| {row['mb']:.2f} | {kld_text(row['kld'])} | {row['recipe']} |")
    print("\nuniform recipes:")
    print("| recipe | MB | decode MB/token | predicted KLD | measured whole |")
    print("|---|---:|---:|---:|---:|")
    for label, row in result["uniform"].items():
        whole = kld_text(row["kld_whole"]) if "kld_whole" in row else "-"
        print(f"| {label} | {row['mb']:.2f} | {row['decode_mb']:.2f} | {kld_text(row['kld_predicted'])} | {whole} |")
    chosen = result["chosen"]
    print(
        f"\nchosen within {budget_mb:g} MB: {chosen['recipe']}\n  {chosen['mb']:.2f} MB, decode reads "
        f"{chosen['decode_mb']:.2f} MB per token; predicted KLD {kld_text(chosen['kld_predicted'])}, measured as a whole "
        f"in PyTorch {kld_text(chosen['kld_whole'])} (top-1 {100 * chosen['top1_whole']:.1f}%)"
    )
    if result["verified"]:
        v = result["verified"]
        same = (
            f" (PyTorch on the same tokens: {kld_text(v['kld_whole_same_tokens'])})"
            if "kld_whole_same_tokens" in v
            else ""
        )
        print(
            f"  exported and measured by composite.eval on {v['tokens']} tokens: KLD {kld_text(v['kld'])}{same}, "
            f"top-1 {100 * v['top1']:.1f}%, .pte files {v['pte_bytes'] / MB:.2f} MB"
            + (" (the host twin: its QNN shards keep their weights once per method)" if v["host_twin"] else "")
        )
    print(f"wrote {result['config']} and {result['plot']}")


def terminated(signum: int, cached: bool) -> None:
    """A terminated tuner ends its measuring worker too, says so in one line, and leaves at once
    (an exception raised here could land where Python ignores it)."""
    ForkedCall.kill_all()
    kept = "; what it measured so far is in its cache: the same command goes on from there" if cached else ""
    quiet.say_at_once(f"error: the tuner was stopped ({signal.Signals(signum).name}); no config was written{kept}")
    os._exit(128 + signum)


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated(signum, cached=not args.no_cache))
    if any(c.quantized_qnn for c in parse_candidates(args.candidates)):
        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    executor = from_ray_flag(args.ray)
    with quiet.filtered_native_stderr(args.verbose):
        result = tune(args, executor)
    if args.json:
        print(json.dumps(result))
    else:
        report(result, args.budget_mb)


if __name__ == "__main__":
    main()
