"""python -m composite.tune: the placement and precision of every shard, chosen by measured KL
divergence against the float model under a size budget, written as an export config.

    python -m composite.tune --checkpoint X --text FILE --budget-mb N [--shards 6]
        [--candidates qnn:fp16,qnn:16a8w,qnn:16a4w,qnn:8a8w,xnnpack:fp32,xnnpack:8da8w,xnnpack:8da4w]
        [--embedding '8,0|4,32|none'] [--rotate none|hadamard|hadamard-ffn] [--ctx N] [--limit-tokens N] [--score all|second-half]
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
"""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    quiet.silence_library_noise()

import argparse
import hashlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import yaml

from composite import qnn_host, shard_cache
from composite.config import ROTATIONS, build_config
from composite.errors import UserError, exits_cleanly
from composite.eval.__main__ import read_text
from composite.eval.scoring import SCORE_MODES
from composite.executor import Job
from composite.executor.fork import ForkedCall, split_work
from composite.export import bos_id
from composite.lowering.task import one_thread
from composite.manifest import sha256_file, versions
from composite.model.checkpoint import load_checkpoint
from composite.model.rotation import rotate
from composite.tokenizer import tokenizer_for_model
from composite.tune.candidates import (
    DEFAULT_CANDIDATES,
    DEFAULT_EMBEDDING,
    Candidate,
    Group,
    group_bytes,
    parse_candidates,
    parse_embedding,
    plan_groups,
)
from composite.tune.search import Option, Recipe, best_within, frontier, thinned
from composite.tune.sensitivity import Sensitivity

MB = 1e6
FRONTIER_ROWS = 16  # the printed frontier; the PNG and --json hold all of it


def kld_text(value: float) -> str:
    return f"{value:.3g}"


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
    p.add_argument("--group-size", type=int, default=32, help="xnnpack 8da4w weight group (default 32)")
    p.add_argument("--soc", default="SM8650", help="QNN SoC the recipe is for (default SM8650)")
    p.add_argument(
        "--rotate",
        choices=ROTATIONS,
        default="none",
        help="measure (and export) the model with its residual stream rotated (hadamard), that and each "
        "feed-forward's hidden activation (hadamard-ffn), or not (default none)",
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


class ResultCache:
    """Measured sensitivities, one JSON file per model, text and settings; None folder: off."""

    def __init__(self, folder: Path | None, common: dict):
        self.path = folder / f"{shard_cache.key_of(common)}.json" if folder is not None else None
        self.results: dict = {}
        if self.path is not None and self.path.exists():
            try:
                self.results = json.loads(self.path.read_text())
            except (OSError, ValueError):
                print(f"warning: ignoring an unreadable tune cache file {self.path}", file=sys.stderr)

    def get(self, key: str) -> dict | None:
        return self.results.get(key)

    def put(self, key: str, value: dict) -> None:
        self.results[key] = value
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(self.results, indent=1, sort_keys=True))
        scratch.replace(self.path)


def cache_folder(args) -> Path | None:
    if args.no_cache:
        return None
    if args.cache_dir:
        return Path(args.cache_dir)
    return Path.home() / ".cache" / "composite" / "tune"


def choice_name(choice) -> str:
    return choice.name if isinstance(choice, Candidate) else f"embedding {choice}"


def choices_for(group: Group, candidates: list[Candidate], embedding: list[str]) -> list:
    return embedding if group.kind == "embedding" else candidates


def measure_cost(group: Group, choice) -> float:
    """A rough share of the measuring time, to split the work between two processes: a QNN
    quantized candidate is traced, calibrated and run as a fake-quantized graph, fp16 runs in half
    precision, XNNPACK's run torchao's eager kernels; the head costs about three layers."""
    if group.kind == "embedding":
        return 0.2
    size = 3.0 if group.kind == "head" else group.layer_end - group.layer_start
    if isinstance(choice, Candidate) and choice.backend == "qnn":
        return size * (2.0 if choice.precision == "fp16" else 3.0)
    return size


def measure(sens: Sensitivity, pairs: list) -> dict:
    """(group index, choice name) -> {"kld", "top1", "seconds"} for `pairs`, measured here, on one
    thread (the figures do not depend on where they are measured: here, a forked process, a Ray
    worker)."""
    with one_thread():
        return measure_here(sens, pairs)


def measure_here(sens: Sensitivity, pairs: list) -> dict:
    qnn_quantized = [
        (g, c) for g, c in pairs if isinstance(c, Candidate) and c.backend == "qnn" and c.precision != "fp16"
    ]
    if qnn_quantized:
        print(f"calibrating {len(qnn_quantized)} quantized QNN graphs ...", file=sys.stderr, flush=True)
        sens.prepare_qnn(qnn_quantized)
    results = {}
    for group, choice in pairs:
        result = sens.evaluate({group.index: choice})
        sens.release(group, choice)
        results[(group.index, choice_name(choice))] = result
        print(
            f"{group.name}, {choice_name(choice)}: KLD {kld_text(result['kld'])}, top-1 "
            f"{100 * result['top1']:.1f}% ({result['seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    return results


def measure_sensitivities(sens: Sensitivity, groups, candidates, embedding, cache: ResultCache, executor=None) -> dict:
    """(group index, choice name) -> {"kld", "top1", "seconds", "cached"}. What the cache does not
    hold is measured in two processes (a fork of this one takes about half of the groups, each
    process builds and calibrates its own groups' QNN graphs): measuring is mostly one thread of
    Python and small tensors, which leaves the second core of a small machine idle otherwise.
    executor (--ray): each (group, choice) a job of its own on the cluster instead."""
    pairs = [(g, c) for g in groups for c in choices_for(g, candidates, embedding)]
    key = {(g.index, choice_name(c)): f"{g.name}|{choice_name(c)}" for g, c in pairs}
    todo = [(g, c) for g, c in pairs if cache.get(key[(g.index, choice_name(c))]) is None]
    if todo:
        print(f"measuring {len(todo)} choices ...", file=sys.stderr, flush=True)
    if executor is not None:
        results: dict = {}
        jobs = [Job(f"measure {key[(g.index, choice_name(c))]}", measure, (sens, [(g, c)])) for g, c in todo]
        executor.run(jobs, lambda done: results.update(done.result))
    else:
        results = measure_in_two_processes(sens, groups, todo)
    for (index, name), result in results.items():
        cache.put(key[(index, name)], result)
    return {
        (g.index, choice_name(c)): {**cache.get(key[(g.index, choice_name(c))]), "cached": (g, c) not in todo}
        for g, c in pairs
    }


def measure_in_two_processes(sens: Sensitivity, groups, todo: list) -> dict:
    """measure() of `todo`, about half of the groups' choices in a forked process."""
    load = {g.index: sum(measure_cost(g, c) for h, c in todo if h is g) for g in groups}
    mine, theirs = split_work({index: cost for index, cost in load.items() if cost})
    worker = ForkedCall(measure, (sens, [(g, c) for g, c in todo if g.index in theirs])) if mine and theirs else None
    try:
        results = measure(sens, [(g, c) for g, c in todo if worker is None or g.index in mine])
        if worker is not None:
            results.update(worker.result())
            worker = None
    finally:
        if worker is not None:
            worker.stop()
    return results


def options_per_group(groups, candidates, embedding, measured, model_args, group_size, rotation) -> list[list[Option]]:
    out = []
    for group in groups:
        options = []
        for choice in choices_for(group, candidates, embedding):
            stored, read = group_bytes(group, choice, model_args, group_size, rotation)
            options.append(
                Option(group.index, choice, stored, read, measured[(group.index, choice_name(choice))]["kld"])
            )
        out.append(options)
    return out


def uniform_recipes(groups, per_group: list[list[Option]], candidates, embedding) -> dict[str, Recipe]:
    """Every group at one candidate, for each embedding choice."""
    out = {}
    for candidate in candidates:
        for emb in embedding:
            chosen = []
            for group, options in zip(groups, per_group):
                wanted = emb if group.kind == "embedding" else candidate
                chosen.append(next(o for o in options if o.choice == wanted))
            label = candidate.name + ("" if emb == "none" else f" + embedding {emb}")
            out[label] = Recipe(tuple(chosen))
    return out


def uniform_candidates(args, candidates: list[Candidate]) -> set[str]:
    """The candidates whose uniform recipes --measure-uniform asks to measure as a whole."""
    if args.measure_uniform is None:
        return set()
    if args.measure_uniform == "all":
        return {c.name for c in candidates}
    wanted = parse_candidates(args.measure_uniform)
    for candidate in wanted:
        if candidate not in candidates:
            raise UserError(f"--measure-uniform {candidate.name} is not among --candidates {args.candidates}")
    return {c.name for c in wanted}


def describe(recipe: Recipe) -> str:
    parts = []
    for option in recipe.options:
        parts.append(f"emb {option.choice}" if isinstance(option.choice, str) else option.choice.name)
    return " | ".join(parts)


def tuned_config(args, groups, recipe: Recipe) -> dict:
    choices = recipe.choices()
    config = {}
    if args.checkpoint:
        config["checkpoint"] = args.checkpoint
    if args.params:
        config["params"] = args.params
    config["shards"] = len(groups)
    config["layers_per_shard"] = [g.layer_end - g.layer_start for g in groups]
    placement = []
    for group in groups:
        if group.kind == "embedding":
            placement.append({"backend": "xnnpack"})  # a lookup: the CPU's
        else:
            placement.append(choices[group.index].placement(head=group.kind == "head"))
    config["placement"] = placement
    if choices[groups[0].index] != "none":
        config["embedding_quantize"] = choices[groups[0].index]
    config["max_seq_len"] = args.max_seq_len
    config["prefill_len"] = args.prefill_len
    config["xnnpack"] = {"group_size": args.group_size}
    config["qnn"] = {"soc": args.soc}
    config["rotate"] = args.rotate  # what was measured, whatever the export's auto would pick
    config["output"] = args.artifacts or f"artifacts/{Path(args.output).stem}"
    return config


def write_config(path: Path, config: dict, header: list[str]) -> None:
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + body)
    build_config(str(path), {})  # the export reads it: refuse to leave one it would not


def plot(path: Path, recipes: list[Recipe], uniform: dict[str, Recipe], chosen: Recipe, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ax.step([r.bytes / MB for r in recipes], [r.kld for r in recipes], where="post", label="tuned (Pareto frontier)")
    for i, (label, recipe) in enumerate(sorted(uniform.items(), key=lambda item: item[1].bytes)):
        ax.scatter(recipe.bytes / MB, recipe.kld, marker="s", s=18, color="gray")
        # Neighbours alternate above and below their point: uniform recipes of close sizes stay legible.
        offset = (3, 3) if i % 2 == 0 else (3, -9)
        ax.annotate(label, (recipe.bytes / MB, recipe.kld), fontsize=6, xytext=offset, textcoords="offset points")
    ax.scatter(chosen.bytes / MB, chosen.kld, marker="*", s=160, color="red", zorder=3, label="chosen")
    ax.axvline(budget, linestyle="--", color="red", linewidth=0.8, label=f"budget {budget:g} MB")
    ax.set_yscale("symlog", linthresh=1e-4)  # a log scale that still shows the float recipe's 0
    ax.set_ylim(bottom=0)
    ax.set_xlabel("weights, MB")
    ax.set_ylabel("predicted mean KLD against the float model")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verify(args, config_path: Path, has_qnn: bool, ctx: int, limit_tokens: int | None) -> dict:
    """The tuned config exported and measured by composite.eval against the float model."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.verify_output or Path(scratch) / "tuned")
        export = [sys.executable, "-m", "composite.export", "--config", str(config_path), "--output", str(folder)]
        if has_qnn:
            export.append("--no-weight-sharing")  # the x86 simulator cannot load weight-shared contexts
        for command in (export,):
            print("$ " + " ".join(command), file=sys.stderr, flush=True)
            done = subprocess.run(command, stdout=sys.stderr)
            if done.returncode != 0:
                raise UserError(f"--verify: the export of {config_path} failed (exit {done.returncode})")
        evaluate = [sys.executable, "-m", "composite.eval", "--artifacts", str(folder), "--text", args.text]
        evaluate += ["--ctx", str(ctx), "--score", args.score, "--reference", "eager", "--json"]
        if limit_tokens:
            evaluate += ["--limit-tokens", str(limit_tokens)]
        print("$ " + " ".join(evaluate), file=sys.stderr, flush=True)
        done = subprocess.run(evaluate, capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"--verify: composite.eval failed: {done.stderr.strip().splitlines()[-1:]}")
        measured = json.loads(done.stdout)
        manifest = json.loads((folder / "manifest.json").read_text())
        files = sum((folder / s["file"]).stat().st_size for s in manifest["shards"])
        return {
            "kld": measured["kld_mean"],
            "top1": measured["top1_agreement"],
            "pte_bytes": files,
            "host_twin": has_qnn,
            "tokens": measured["tokens"],
        }


def tune(args, executor=None) -> dict:
    check_args(args)
    candidates = parse_candidates(args.candidates)
    embedding = parse_embedding(args.embedding)
    measured_uniform = uniform_candidates(args, candidates)
    if any(c.backend == "qnn" and c.precision != "fp16" for c in candidates):
        qnn_host.activate()
    text = read_text(args.text)
    if not text.strip():
        raise UserError(f"--text {args.text} is empty: the measurements need real text")
    loaded = load_checkpoint(args.checkpoint, args.params)
    model = loaded.model.eval()
    rotate(model, args.rotate)
    tokenizer = tokenizer_for_model(loaded.tokenizer_path, model.args.vocab_size)
    if tokenizer is None:
        raise UserError("composite.tune reads a text: this checkpoint has no tokenizer beside it")
    bos = bos_id(loaded, tokenizer)
    groups = plan_groups(model.args, args.shards)
    smallest = sum(
        min(
            group_bytes(g, c, model.args, args.group_size, args.rotate)[0]
            for c in choices_for(g, candidates, embedding)
        )
        for g in groups
    )
    if smallest > args.budget_mb * MB:
        raise UserError(
            f"--budget-mb {args.budget_mb:g} is below the smallest recipe these candidates allow "
            f"({smallest / MB:.2f} MB): raise the budget or add smaller candidates"
        )
    ctx = args.ctx or args.max_seq_len
    common = {
        "versions": versions(),
        # the code that measures (the command lines, __main__.py, only print and dispatch)
        "source": shard_cache.source_fingerprint(excluded=("bench", "__main__.py")),
        "model": shard_cache.tensors_digest(model),
        "tokenizer": sha256_file(tokenizer.path),
        "bos": bos,
        "text": hashlib.sha256(text.encode()).hexdigest(),
        "ctx": ctx,
        "limit_tokens": args.limit_tokens,
        "score": args.score,
        "max_seq_len": args.max_seq_len,
        "prefill_len": args.prefill_len,
        "group_size": args.group_size,
        "soc": args.soc,
        "rotate": args.rotate,
        "groups": [[g.kind, g.layer_start, g.layer_end] for g in groups],
    }
    cache = ResultCache(cache_folder(args), common)
    sens = Sensitivity(
        model,
        groups,
        tokenizer,
        bos,
        text,
        ctx,
        args.limit_tokens,
        args.score,
        args.max_seq_len,
        args.prefill_len,
        args.group_size,
        args.soc,
    )
    measured = measure_sensitivities(sens, groups, candidates, embedding, cache, executor)
    per_group = options_per_group(groups, candidates, embedding, measured, model.args, args.group_size, args.rotate)
    recipes = frontier(per_group)
    budget_bytes = int(args.budget_mb * MB)
    chosen = best_within(recipes, budget_bytes)  # the smallest recipe fits: checked above
    uniform = uniform_recipes(groups, per_group, candidates, embedding)

    def measure_whole(recipe: Recipe) -> dict:
        key = "whole|" + describe(recipe)
        if cache.get(key) is None:
            qnn = [
                (groups[o.group], o.choice)
                for o in recipe.options
                if isinstance(o.choice, Candidate) and o.choice.backend == "qnn" and o.choice.precision != "fp16"
            ]
            sens.prepare_qnn(qnn)
            cache.put(key, sens.evaluate(recipe.choices()))
        return cache.get(key)

    whole = measure_whole(chosen)
    uniform_whole = {
        label: measure_whole(recipe) for label, recipe in uniform.items() if label.split(" + ")[0] in measured_uniform
    }

    output = Path(args.output)
    header = [
        f"composite.tune: lowest predicted KLD within {args.budget_mb:g} MB over {args.candidates}",
        f"checkpoint {args.checkpoint or '(embedded default)'}, text {args.text}, {sens.scored_tokens} tokens scored",
        f"weights {chosen.bytes / MB:.2f} MB; predicted KLD {kld_text(chosen.kld)} (sum of groups), "
        f"measured as a whole in PyTorch {kld_text(whole['kld'])}, top-1 {100 * whole['top1']:.1f}%",
    ]
    config = tuned_config(args, groups, chosen)
    write_config(output, config, header)
    plot_path = Path(args.plot or output.with_suffix(".png"))
    plot(plot_path, recipes, uniform, chosen, args.budget_mb)
    verified = None
    if args.verify:
        has_qnn = any(isinstance(c, Candidate) and c.backend == "qnn" for c in chosen.choices().values())
        limit = args.verify_limit_tokens or args.limit_tokens
        verified = verify(args, output, has_qnn, ctx, limit)
        if args.verify_limit_tokens:
            # the PyTorch figure on the tokens the export was measured on, beside the export's
            same_tokens = sens.evaluate(chosen.choices(), chunk_count=args.verify_limit_tokens // ctx)
            verified["kld_whole_same_tokens"] = same_tokens["kld"]
    return {
        "groups": [
            {
                "group": g.name,
                "shard": g.index,
                "choices": {
                    choice_name(o.choice): {
                        "mb": round(o.bytes / MB, 3),
                        "kld": o.kld,
                        "top1": measured[(g.index, choice_name(o.choice))]["top1"],
                        "cached": measured[(g.index, choice_name(o.choice))]["cached"],
                    }
                    for o in options
                },
            }
            for g, options in zip(groups, per_group)
        ],
        "frontier": [{"mb": round(r.bytes / MB, 3), "kld": r.kld, "recipe": describe(r)} for r in recipes],
        "uniform": {
            label: {
                "mb": round(r.bytes / MB, 3),
                "decode_mb": round(r.decode_bytes / MB, 3),
                "kld_predicted": r.kld,
                **(
                    {"kld_whole": uniform_whole[label]["kld"], "top1_whole": uniform_whole[label]["top1"]}
                    if label in uniform_whole
                    else {}
                ),
            }
            for label, r in uniform.items()
        },
        "chosen": {
            "recipe": describe(chosen),
            "mb": round(chosen.bytes / MB, 3),
            "decode_mb": round(chosen.decode_bytes / MB, 3),
            "kld_predicted": chosen.kld,
            "kld_whole": whole["kld"],
            "top1_whole": whole["top1"],
        },
        "verified": verified,
        "scored_tokens": sens.scored_tokens,
        "config": str(output),
        "plot": str(plot_path),
    }


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


def terminated(signum, _frame):
    """A terminated tuner ends its measuring worker too (an exception raised here could land where
    Python ignores it)."""
    ForkedCall.kill_all()
    os._exit(128 + signum)


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)
    if any(c.backend == "qnn" and c.precision != "fp16" for c in parse_candidates(args.candidates)):
        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    executor = None
    if args.ray is not None:
        from composite.executor.ray_cluster import RayExecutor

        executor = RayExecutor(args.ray or None)  # connects now: one line before any work if it cannot
    with quiet.filtered_native_stderr(args.verbose):
        result = tune(args, executor)
    if args.json:
        print(json.dumps(result))
    else:
        report(result, args.budget_mb)


if __name__ == "__main__":
    main()
