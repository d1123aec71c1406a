"""docs/quality.md's table, on demand: each placement of a checkpoint exported, then scored by
composite.eval against the float model (--reference eager) on real text.

    python scripts/quality_table.py --checkpoint checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text /usr/share/common-licenses/GPL-3 [--ctx 512] [--limit-tokens 2048] \\
        [--qnn-limit-tokens 512] [--rows fp32,8da8w,...] [--llama-cpp DIR] [--workdir DIR]

Every row is one `composite.export` (printed) and one `composite.eval --reference eager --score
second-half` (llama.cpp's convention, so the figures compare with llama-perplexity's). Exports go
through the shard cache, so rows that share shards re-lower only what differs. QNN rows run on the
x86 HTP simulator, slowly: they score the text's first --qnn-limit-tokens tokens. Prints a markdown
table; --workdir keeps the exports (default: a temporary folder, removed at the end).

The llama.cpp rows (a GGUF checkpoint only; llama.cpp built by scripts/build_llama_cpp.sh): F32 is
the checkpoint dequantized by `llama-quantize --allow-requantize` (the same float weights our
export reads), Q8_0 / Q4_0 / Q4_1 are quantized from it with llama-quantize's default tensor types,
and `llama-perplexity --kl-divergence` scores each against F32's stored probabilities on the same
text, ctx and number of chunks (it scores the second half of each chunk).

--ray [ADDRESS] runs each of our rows (its export and its eval) as a job on a Ray cluster: the
checkpoint's and the text's bytes travel through the object store, each row works in a scratch
folder of its node, and rows are printed as they finish. The llama.cpp rows run here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from composite.errors import UserError, exits_cleanly  # noqa: E402
from composite.manifest_files import stored_bytes  # noqa: E402
from composite.model.checkpoint import load_checkpoint  # noqa: E402

# XNNPACK rows: the embedding alone in shard 0, the layers in two more (--layers-per-shard is set per
# checkpoint in main), so rows that differ only in the embedding take the layer shards from the cache.
XNNPACK = ["--shards", "3"]
# The main job's placement: XNNPACK ends, four QNN shards of two layers (configs/smollm2.yaml).
QNN = ["--config", "configs/smollm2.yaml", "--no-weight-sharing"]
TORCHAO = ["--head-quantize", "same", "--weight-mapping", "symmetric"]  # torchao's own choices
NO_ROTATION = ["--rotate", "none"]
EMBEDDINGS = {
    "": ([], ""),
    "-emb8": (["--embedding-quantize", "8,0"], ", embedding 8,0"),
    "-emb4": (["--embedding-quantize", "4,32"], ", embedding 4,32"),
}
BASES = {
    "fp16": ("XNNPACK fp16", [*XNNPACK, "--dtype", "fp16"]),
    "8da8w": (
        "XNNPACK 8da8w (defaults: residual and feed-forward rotations, unclipped scales)",
        [*XNNPACK, "--quantize", "8da8w"],
    ),
    "8da4w": (
        "XNNPACK 8da4w g32 (defaults: 8-bit head, unclipped scales, not rotated)",
        [*XNNPACK, "--quantize", "8da4w", "--group-size", "32"],
    ),
    "8da4w-g128": (
        "XNNPACK 8da4w g128 (a linear whose in_features is no multiple of 128 stays fp32)",
        [*XNNPACK, "--quantize", "8da4w", "--group-size", "128"],
    ),
}
ROWS = {
    "fp32": ("XNNPACK fp32, 3 shards", XNNPACK),
    **{
        base + suffix: (label + described, flags + extra)
        for base, (label, flags) in BASES.items()
        for suffix, (extra, described) in EMBEDDINGS.items()
    },
    "8da8w-torchao": (
        "XNNPACK 8da8w, torchao's symmetric scales, not rotated",
        [*BASES["8da8w"][1], *TORCHAO, *NO_ROTATION],
    ),
    "8da8w-norot": ("XNNPACK 8da8w, not rotated", [*BASES["8da8w"][1], *NO_ROTATION]),
    "8da8w-residual": ("XNNPACK 8da8w, residual rotation only", [*BASES["8da8w"][1], "--rotate", "hadamard"]),
    "8da8w-residual-emb8": (
        "XNNPACK 8da8w, residual rotation only, embedding 8,0",
        [*BASES["8da8w"][1], "--rotate", "hadamard", *EMBEDDINGS["-emb8"][0]],
    ),
    "8da4w-torchao": ("XNNPACK 8da4w g32, torchao's choices (4-bit head, symmetric)", [*BASES["8da4w"][1], *TORCHAO]),
    "8da4w-head8": ("XNNPACK 8da4w g32, 8-bit head, symmetric", [*BASES["8da4w"][1], "--weight-mapping", "symmetric"]),
    "8da4w-rot": ("XNNPACK 8da4w g32, rotated", [*BASES["8da4w"][1], "--rotate", "hadamard"]),
    **{
        f"qnn-{precision}": (
            f"QNN {precision} (8 layers, simulator), XNNPACK fp32 ends",
            [*QNN, "--qnn-precision", precision],
        )
        for precision in ("fp16", "16a16w", "16a8w", "16a4w", "8a8w")
    },
    "qnn-16a8w-norot": (
        "QNN 16a8w (8 layers, simulator), not rotated",
        [*QNN, "--qnn-precision", "16a8w", *NO_ROTATION],
    ),
}
# llama.cpp's types, each a row "llama.cpp-<type>"; F32 is the reference the others are scored against.
LLAMA_CPP_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1")
LLAMA_CPP_ROWS = {f"llama.cpp-{t}": t for t in LLAMA_CPP_TYPES}
LLAMA_CPP_DEFAULT = Path.home() / ".cache" / "composite" / "llama.cpp"
# What llama-perplexity --kl-divergence prints, by our JSON names.
LLAMA_CPP_FIGURES = {
    "perplexity": r"Mean PPL\(Q\)\s*:\s*([0-9.]+)",
    "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.]+)",
    "kld_mean": r"Mean\s+KLD:\s*(-?[0-9.]+)",
    "kld_p99": r"99\.0%\s+KLD:\s*(-?[0-9.]+)",
    "top1_agreement": r"Same top p:\s*([0-9.]+)",
    "rms_dp": r"RMS Δp\s*:\s*([0-9.]+)",
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--limit-tokens", type=int, default=2048)
    p.add_argument("--qnn-limit-tokens", type=int, default=512)
    every = [*ROWS, *LLAMA_CPP_ROWS]
    p.add_argument("--rows", default=",".join(every), help=f"comma separated, of {', '.join(every)}")
    p.add_argument(
        "--llama-cpp", default=str(LLAMA_CPP_DEFAULT), help=f"llama.cpp's build (default {LLAMA_CPP_DEFAULT})"
    )
    p.add_argument("--workdir", help="keep the exports here")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="run our rows as jobs on a Ray cluster")
    args = p.parse_args(argv)
    unknown = [row for row in args.rows.split(",") if row not in every]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; rows are {', '.join(every)}")
    if any(row in LLAMA_CPP_ROWS for row in args.rows.split(",")):
        if not args.checkpoint.endswith(".gguf"):
            p.error("the llama.cpp rows quantize a GGUF checkpoint; --checkpoint is not one")
        if not (Path(args.llama_cpp) / "build" / "bin" / "llama-perplexity").is_file():
            p.error(
                f"llama.cpp's llama-perplexity is not built in {args.llama_cpp}: run bash scripts/build_llama_cpp.sh"
            )
    return args


def run(command: list[str]) -> str:
    """One of our CLIs; a failure is an exception (a Ray worker must not exit), its last line said."""
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, *command], cwd=REPO if REPO.is_dir() else None, capture_output=True, text=True
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{' '.join(command)} failed ({done.returncode}): {last}")
    return done.stdout


def run_llama_cpp(command: list[str]) -> str:
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def llama_cpp_row(args, workdir: Path, gguf_type: str, flags: tuple[str, ...] = (), name: str | None = None) -> dict:
    """One llama.cpp type scored against its F32 (made, and its probabilities stored, once);
    flags: more llama-quantize flags (tensor types), name: the file's stem then."""
    bin_dir = Path(args.llama_cpp) / "build" / "bin"
    f32, base = workdir / "llama-F32.gguf", workdir / "llama-F32.kld"
    chunks = ["-c", str(args.ctx), "--chunks", str(args.limit_tokens // args.ctx), "-t", str(os.cpu_count())]
    if not base.exists():
        quantize = [str(bin_dir / "llama-quantize"), "--allow-requantize", args.checkpoint, str(f32), "F32"]
        run_llama_cpp(quantize)
        run_llama_cpp(
            [
                str(bin_dir / "llama-perplexity"),
                "-m",
                str(f32),
                "-f",
                args.text,
                *chunks,
                "--kl-divergence-base",
                str(base),
            ]
        )
    model = f32
    if gguf_type != "F32":
        model = workdir / f"llama-{name or gguf_type}.gguf"
        run_llama_cpp([str(bin_dir / "llama-quantize"), *flags, str(f32), str(model), gguf_type])
    log = run_llama_cpp(
        [
            str(bin_dir / "llama-perplexity"),
            "-m",
            str(model),
            *chunks,
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
        ]
    )
    figures = {}
    for name, pattern in LLAMA_CPP_FIGURES.items():
        found = re.search(pattern, log)
        if found is None:
            sys.exit(f"llama-perplexity printed no {name} for {model}:\n{log[-2000:]}")
        figures[name] = float(found.group(1))
    figures["top1_agreement"] /= 100
    figures["rms_dp"] /= 100
    half = args.ctx // 2
    figures["tokens"] = (args.limit_tokens // args.ctx) * (args.ctx - 1 - half)
    figures["size_mb"] = model.stat().st_size / 1e6
    return figures


def print_row(label: str, size_mb: float, result: dict) -> None:
    print(
        f"| {label} | {size_mb:.1f} | {result['tokens']} | {result['perplexity']:.3f} | {result['ppl_ratio']:.4f} "
        f"| {result['kld_mean']:.4f} "
        f"| {result['kld_p99']:.4f} | {100 * result['top1_agreement']:.1f}% | {100 * result['rms_dp']:.2f}% |",
        flush=True,
    )


def row_flags(row: str, n_layers: int) -> list[str]:
    flags = ROWS[row][1]
    if flags[:2] == XNNPACK:
        flags = [*flags, "--layers-per-shard", f"0,{n_layers // 2},{n_layers - n_layers // 2}"]
    return flags


def measure_row(row: str, flags: list[str], checkpoint: Path, text: Path, ctx: int, limit: int, folder: Path) -> tuple:
    """One row: its export into `folder` and composite.eval of it. -> (row, size MB, eval's result)."""
    export = ["-m", "composite.export", *flags, "--checkpoint", str(checkpoint)]
    run([*export, "--max-seq-len", str(ctx), "--output", str(folder)])
    evaluate = ["-m", "composite.eval", "--artifacts", str(folder), "--text", str(text)]
    evaluate += ["--ctx", str(ctx), "--limit-tokens", str(limit), "--score", "second-half"]
    result = json.loads(run([*evaluate, "--reference", "eager", "--json"]))
    manifest = json.loads((folder / "manifest.json").read_text())
    return row, stored_bytes(manifest["shards"]) / 1e6, result


def checkpoint_files(path: Path) -> tuple[str, dict[str, bytes]]:
    """(what --checkpoint names in the folder, name -> bytes of every file it needs): a folder's
    files, or a file with the params.json and tokenizer.model beside it."""
    if path.is_dir():
        return ".", {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()}
    beside = [path.parent / name for name in ("params.json", "tokenizer.model") if (path.parent / name).is_file()]
    return path.name, {f.name: f.read_bytes() for f in [path, *beside]}


def measure_row_anywhere(row: str, flags: list[str], checkpoint: tuple, text: bytes, ctx: int, limit: int) -> tuple:
    """measure_row on a node that has neither file: checkpoint = checkpoint_files()."""
    name, files = checkpoint
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "checkpoint").mkdir()
        for file, data in files.items():
            (folder / "checkpoint" / file).write_bytes(data)
        (folder / "text.txt").write_bytes(text)
        return measure_row(row, flags, folder / "checkpoint" / name, folder / "text.txt", ctx, limit, folder / row)


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    n_layers = load_checkpoint(args.checkpoint, None).args.n_layers
    rows = args.rows.split(",")
    ours = [row for row in rows if row not in LLAMA_CPP_ROWS]

    def limit(row: str) -> int:
        return args.qnn_limit_tokens if row.startswith("qnn") else args.limit_tokens

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        print("| placement | size MB | tokens | PPL | PPL ratio | mean KLD | KLD p99 | top-1 | RMS Δp |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        if args.ray is not None:
            from composite.executor import Job
            from composite.executor.ray_cluster import from_ray_flag

            checkpoint = checkpoint_files(Path(args.checkpoint))
            text = Path(args.text).read_bytes()
            jobs = [
                Job(
                    f"row {row}",
                    measure_row_anywhere,
                    (row, row_flags(row, n_layers), checkpoint, text, args.ctx, limit(row)),
                )
                for row in ours
            ]
            from_ray_flag(args.ray).run(jobs, lambda done: print_row(ROWS[done.result[0]][0], *done.result[1:]))
        else:
            for row in ours:
                folder = workdir / row
                _, size, result = measure_row(
                    row, row_flags(row, n_layers), Path(args.checkpoint), Path(args.text), args.ctx, limit(row), folder
                )
                print_row(ROWS[row][0], size, result)
        for row in rows:
            if row in LLAMA_CPP_ROWS:
                result = llama_cpp_row(args, workdir, LLAMA_CPP_ROWS[row])
                print_row(f"llama.cpp {LLAMA_CPP_ROWS[row]} (against its F32)", result["size_mb"], result)


if __name__ == "__main__":
    main()
