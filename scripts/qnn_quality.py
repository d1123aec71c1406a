"""docs/quality.md's table of 4-bit weights on the NPU, on demand: decoder layers of a checkpoint at
QNN precisions (the rest float), measured in PyTorch, beside llama.cpp at the same bits on the same
tokens.

    python scripts/qnn_quality.py --checkpoint checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text /usr/share/common-licenses/GPL-3 [--ctx 512] [--limit-tokens 2048] [--rows ...] \\
        [--llama-cpp DIR] [--workdir DIR] [--recipe FILE.yaml]

Our rows: the converted (fake-quantized) graphs the export lowers for each QNN shard, calibrated
as the export calibrates them and run as its prefill method runs (composite.tune's Sensitivity),
the embedding and head in float; KLD against the float model on the text cut into --ctx chunks,
the second half of each scored (llama.cpp's convention). `--recipe FILE` adds a row of a tuned
export config (composite.tune's output: each layer group's QNN precision). llama.cpp's rows
quantize the checkpoint's F32 with llama-quantize (`--pure`, and f32 outside the layers a row names)
and score them with `llama-perplexity --kl-divergence` against F32 on the same chunks. Bits per
weight: a row's stored bytes of the quantized decoder layers (weights, scales, norms) x 8 over
their linear weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from composite import quiet  # noqa: E402

quiet.silence_library_noise()

from quality_table import LLAMA_CPP_DEFAULT, llama_cpp_row  # noqa: E402

from composite.errors import UserError, exits_cleanly  # noqa: E402

MIDDLE = (11, 19)  # the main job's QNN layers (configs/smollm2.yaml)
ALL = (0, None)  # every decoder layer
# name -> (label, rotation, QNN options, layer range -> candidate)
ROWS = {
    "16a4w-middle": ("QNN 16a4w per channel, not rotated", "none", {}, {MIDDLE: "qnn:16a4w"}),
    "block32-nearest-middle": (
        "QNN 16a4w_block 32, nearest, not rotated",
        "none",
        {"block_size": 32, "rounding": "nearest"},
        {MIDDLE: "qnn:16a4w_block"},
    ),
    "block32-middle": (
        "QNN 16a4w_block 32 (defaults)",
        "hadamard-ffn",
        {"block_size": 32},
        {MIDDLE: "qnn:16a4w_block"},
    ),
    "16a4w-all": ("QNN 16a4w per channel, not rotated", "none", {}, {ALL: "qnn:16a4w"}),
    "block32-nearest-all": (
        "QNN 16a4w_block 32, nearest, not rotated",
        "none",
        {"block_size": 32, "rounding": "nearest"},
        {ALL: "qnn:16a4w_block"},
    ),
    "block32-all": ("QNN 16a4w_block 32 (defaults)", "hadamard-ffn", {"block_size": 32}, {ALL: "qnn:16a4w_block"}),
    "block64-all": ("QNN 16a4w_block 64", "hadamard-ffn", {"block_size": 64}, {ALL: "qnn:16a4w_block"}),
    "block16-all": ("QNN 16a4w_block 16", "hadamard-ffn", {"block_size": 16}, {ALL: "qnn:16a4w_block"}),
    "16a8w-all": ("QNN 16a8w", "hadamard-ffn", {}, {ALL: "qnn:16a8w"}),
    "8da4w-all": ("XNNPACK 8da4w g32, not rotated", "none", {}, {ALL: "xnnpack:8da4w"}),
}
# name -> (label, llama-quantize type, layer range at that type (the rest f32) or None (its default mix))
LLAMA_CPP = {
    "llama.cpp-Q4_0-middle": ("llama.cpp Q4_0 (--pure)", "Q4_0", MIDDLE),
    "llama.cpp-Q4_0-all": ("llama.cpp Q4_0 (--pure), ends f32", "Q4_0", ALL),
    "llama.cpp-Q4_K_M-all": ("llama.cpp Q4_K_M (its mix), ends f32", "Q4_K_M", ALL),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--limit-tokens", type=int, default=2048)
    every = [*ROWS, *LLAMA_CPP]
    p.add_argument("--rows", default=",".join(every), help=f"comma separated, of {', '.join(every)}")
    p.add_argument("--recipe", action="append", default=[], help="a tuned export config (YAML): one more row")
    p.add_argument(
        "--llama-cpp", default=str(LLAMA_CPP_DEFAULT), help=f"llama.cpp's build (default {LLAMA_CPP_DEFAULT})"
    )
    p.add_argument("--workdir", help="keep llama.cpp's files here")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    unknown = [row for row in args.rows.split(",") if row and row not in every]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; rows are {', '.join(every)}")
    return args


def layer_ranges(recipe: dict, n_layers: int) -> dict[tuple[int, int], str]:
    return {(first, n_layers if end is None else end): choice for (first, end), choice in recipe.items()}


def recipe_row(path: str, n_layers: int) -> tuple:
    """A tuned config as a row: each QNN shard's layers at its precision (its overrides left out)."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    counts, placement = config["layers_per_shard"], config["placement"]
    ranges, first = {}, 0
    for count, entry in zip(counts, placement):
        if count and entry.get("backend") == "qnn":
            ranges[(first, first + count)] = f"qnn:{entry.get('precision') or config['qnn'].get('precision', 'fp16')}"
        elif count and entry.get("quantize"):
            ranges[(first, first + count)] = f"xnnpack:{entry['quantize']}"
        first += count
    qnn = {k: v for k, v in config.get("qnn", {}).items() if k in ("block_size", "rounding")}
    return (f"tuned: {Path(path).name}", config.get("rotate", "none"), qnn, ranges)


def measure_ours(args, rows: dict[str, tuple], loaded, tokenizer, bos) -> dict[str, dict]:
    """Each row's KLD, top-1 and bits per weight, one Sensitivity (a float pass over the text) per
    rotation and QNN options."""
    from composite.eval.scoring import read_text
    from composite.model.rotation import rotate
    from composite.tune.candidates import Candidate, Group, group_bytes
    from composite.tune.sensitivity import Sensitivity

    args_ = loaded.args
    text = read_text(args.text)
    cuts = sorted({0, args_.n_layers} | {b for row in rows.values() for r in row[3] for b in r})
    groups = [Group("embedding", 0)]
    groups += [Group("layers", i + 1, a, b) for i, (a, b) in enumerate(itertools.pairwise(cuts))]
    groups.append(Group("head", len(groups)))
    params_per_layer = sum(o * i for o, i in _layer_linears(args_))
    results, built = {}, {}
    by_model = sorted(rows.items(), key=lambda item: json.dumps(item[1][1:3], sort_keys=True))
    for name, (label, rotation, qnn, ranges) in by_model:
        key = json.dumps([rotation, qnn], sort_keys=True)
        if key not in built:
            model = loaded.part(True, range(args_.n_layers), True).eval()
            rotate(model, rotation)
            sens = Sensitivity(
                model=model,
                groups=groups,
                tokenizer=tokenizer,
                bos_id=bos,
                text=text,
                ctx=args.ctx,
                limit_tokens=args.limit_tokens,
                score="second-half",
                max_seq_len=args.ctx,
                prefill_len=32,
                group_size=32,
                soc="SM8650",
                qnn_options=qnn,
            )
            built = {key: sens}
        sens = built[key]
        recipe, stored, layers = {}, 0, 0
        for (first, end), choice in ranges.items():
            backend, precision = choice.split(":")
            for group in groups:
                if group.kind == "layers" and first <= group.layer_start and group.layer_end <= end:
                    recipe[group.index] = candidate = Candidate(backend, precision)
                    stored += group_bytes(group, candidate, args_, 32, rotation, qnn.get("block_size", 32))[0]
                    layers += group.layer_end - group.layer_start
        sens.prepare_qnn([(groups[i], c) for i, c in recipe.items() if c.quantized_qnn])
        measured = sens.evaluate(recipe)
        for i, c in recipe.items():
            sens.release(groups[i], c)
        results[name] = {
            "label": label,
            "layers": layers,
            "bits_per_weight": 8 * stored / (params_per_layer * layers),
            "kld_mean": measured["kld"],
            "top1_agreement": measured["top1"],
            "tokens": sens.scored_tokens,
        }
        print_row(results[name])
    return results


def _layer_linears(args_):
    from composite.tune.candidates import layer_linears

    return layer_linears(args_)


def measure_llama_cpp(args, rows: dict[str, tuple], n_layers: int, workdir: Path) -> dict[str, dict]:
    import gguf

    results = {}
    for name, (label, gguf_type, ranged) in rows.items():
        first, end = ranged[0], n_layers if ranged[1] is None else ranged[1]
        flags = ["--token-embedding-type", "f32", "--output-tensor-type", "f32"]
        if gguf_type == "Q4_0":
            flags.append("--pure")
        others = [str(i) for i in range(n_layers) if not first <= i < end]
        if others:
            flags += ["--tensor-type", rf"blk\.({'|'.join(others)})\.=f32"]
        figures = llama_cpp_row(args, workdir, gguf_type, tuple(flags), name)
        reader = gguf.GGUFReader(str(workdir / f"llama-{name}.gguf"))
        layer_bytes = sum(int(t.n_bytes) for t in reader.tensors if _in_layers(t.name, first, end))
        weights = sum(int(t.n_elements) for t in reader.tensors if _in_layers(t.name, first, end) and len(t.shape) == 2)
        results[name] = {"label": label, "layers": end - first, "bits_per_weight": 8 * layer_bytes / weights, **figures}
        print_row(results[name])
    return results


def _in_layers(tensor: str, first: int, end: int) -> bool:
    parts = tensor.split(".")
    return parts[0] == "blk" and first <= int(parts[1]) < end


def print_row(row: dict) -> None:
    print(
        f"| {row['label']} | {row['layers']} | {row['bits_per_weight']:.2f} | {row['tokens']} "
        f"| {row['kld_mean']:.4f} | {100 * row['top1_agreement']:.1f}% |",
        flush=True,
    )


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    from composite.model.checkpoint import load_checkpoint
    from composite.tokenizer import prompt_bos_id, tokenizer_for_model

    loaded = load_checkpoint(args.checkpoint, None)
    tokenizer = tokenizer_for_model(loaded.tokenizer_path, loaded.args.vocab_size)
    if tokenizer is None:
        raise UserError("the checkpoint has no tokenizer beside it: the rows score a text")
    bos = prompt_bos_id(loaded, tokenizer)
    n_layers = loaded.args.n_layers
    names = [row for row in args.rows.split(",") if row]
    ours = {name: (*ROWS[name][:3], layer_ranges(ROWS[name][3], n_layers)) for name in names if name in ROWS}
    for path in args.recipe:
        ours[f"recipe:{path}"] = recipe_row(path, n_layers)
    print("| placement of the decoder layers (the rest float) | layers | bits per weight | tokens | mean KLD | top-1 |")
    print("|---|---:|---:|---:|---:|---:|")
    results = measure_ours(args, ours, loaded, tokenizer, bos)
    llama = {name: LLAMA_CPP[name] for name in names if name in LLAMA_CPP}
    if llama:
        if not args.checkpoint.endswith(".gguf"):
            raise UserError("llama.cpp's rows quantize a GGUF checkpoint; --checkpoint is not one")
        with tempfile.TemporaryDirectory() as scratch:
            results |= measure_llama_cpp(args, llama, n_layers, Path(args.workdir or scratch))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
