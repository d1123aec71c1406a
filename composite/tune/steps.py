"""The steps of composite.tune (its CLI, __main__.py, parses and reports): read the inputs; build
each searched rotation's model; measure every group's choices (every rotation's in one run on a
cluster); for each rotation search the frontier and measure the chosen recipe whole; keep the better
rotation; write the config and its plot; verify by export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from composite import qnn_host, shard_cache
from composite.config import build_config
from composite.errors import UserError
from composite.eval.__main__ import read_text
from composite.executor import Job
from composite.executor.fork import ForkedCall, split_work
from composite.lowering.task import one_thread
from composite.manifest import sha256_file, versions
from composite.model.checkpoint import load_checkpoint
from composite.model.rotation import rotate
from composite.tokenizer import prompt_bos_id, tokenizer_for_model
from composite.tune.candidates import (
    Candidate,
    Group,
    group_bytes,
    parse_candidates,
    parse_embedding,
    plan_groups,
)
from composite.tune.search import Option, Recipe, best_within, frontier
from composite.tune.sensitivity import Sensitivity

MB = 1e6


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


def measure_sensitivities(searches: list[Measuring], groups, candidates, embedding, executor=None) -> list[dict]:
    """For each rotation's search: (group index, choice name) -> {"kld", "top1", "seconds", "cached"}.
    What its cache does not hold is measured in two processes (a fork of this one takes about half
    of the groups, each process builds and calibrates its own groups' QNN graphs): measuring is
    mostly one thread of Python and small tensors, which leaves the second core of a small machine
    idle otherwise. executor (--ray): each (group, choice) of every search a job of its own, all in
    one run on the cluster, so that its workers start and import torch once, not once per search."""

    def key(group, choice) -> str:
        return f"{group.name}|{choice_name(choice)}"

    pairs = [(g, c) for g in groups for c in choices_for(g, candidates, embedding)]
    todo = [[(g, c) for g, c in pairs if m.cache.get(key(g, c)) is None] for m in searches]
    if any(todo):
        print(f"measuring {sum(map(len, todo))} choices ...", file=sys.stderr, flush=True)
    if executor is not None:
        results: list[dict] = [{} for _ in searches]
        jobs, search_of = [], {}
        for i, (m, pending) in enumerate(zip(searches, todo)):
            for g, c in pending:
                jobs.append(Job(f"measure {m.rotation}|{key(g, c)}", measure, (m.sens, [(g, c)]), own_process=False))
                search_of[jobs[-1].name] = i
        executor.run(jobs, lambda done: results[search_of[done.job.name]].update(done.result))
    else:
        results = [measure_in_two_processes(m.sens, groups, pending) for m, pending in zip(searches, todo)]
    measured = []
    for m, pending, found in zip(searches, todo, results):
        for g, c in pending:
            m.cache.put(key(g, c), found[(g.index, choice_name(c))])
        measured.append(
            {(g.index, choice_name(c)): {**m.cache.get(key(g, c)), "cached": (g, c) not in pending} for g, c in pairs}
        )
    return measured


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


def tuned_config(args, groups, recipe: Recipe, rotation: str) -> dict:
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
    config["rotate"] = rotation  # what was measured, whatever the export's auto would pick
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


def kld_text(value: float) -> str:
    return f"{value:.3g}"


@dataclasses.dataclass
class Inputs:
    """What every rotation's search shares: the choices, the text, the checkpoint and its tokenizer."""

    candidates: list[Candidate]
    embedding: list[str]
    measured_uniform: set[str]  # the candidates whose uniform recipes are measured whole
    text: str
    loaded: object  # LoadedModel
    tokenizer: object
    bos: int | None
    groups: list[Group]


@dataclasses.dataclass
class Search:
    """One rotation's measurements and what the search made of them."""

    rotation: str
    sens: Sensitivity
    measured: dict  # (group index, choice name) -> {"kld", "top1", "seconds", "cached"}
    per_group: list[list[Option]]
    recipes: list[Recipe]  # the Pareto frontier
    chosen: Recipe
    whole: dict  # the chosen recipe measured as a whole
    uniform: dict[str, Recipe]
    uniform_whole: dict[str, dict]


def tune(args, executor=None) -> dict:
    """The tuned config for `args` (__main__.parse_args); executor: where the measurements run
    (default: this process and a fork of it). -> the summary __main__.report prints."""
    inputs = read_inputs(args)
    rotations = rotations_to_search(args.rotate, inputs.candidates)
    fitting = [r for r in rotations if smallest_bytes(args, inputs, r) <= args.budget_mb * MB]
    if not fitting:
        smallest = min(smallest_bytes(args, inputs, r) for r in rotations)
        raise UserError(
            f"--budget-mb {args.budget_mb:g} is below the smallest recipe these candidates allow "
            f"({smallest / MB:.2f} MB): raise the budget or add smaller candidates"
        )
    measurings = [measuring(args, inputs, rotation) for rotation in fitting]
    measured = measure_sensitivities(measurings, inputs.groups, inputs.candidates, inputs.embedding, executor)
    searches = [search(args, inputs, m, found) for m, found in zip(measurings, measured)]
    best = min(searches, key=lambda s: s.whole["kld"])  # the better at the budget, each measured whole
    output = Path(args.output)
    write_config(output, tuned_config(args, inputs.groups, best.chosen, best.rotation), header(args, best))
    plot_path = Path(args.plot or output.with_suffix(".png"))
    plot(plot_path, best.recipes, best.uniform, best.chosen, args.budget_mb)
    verified = verify_chosen(args, best, output) if args.verify else None
    return summary(best, searches, verified, output, plot_path)


def rotations_to_search(rotate_flag: str, candidates: list[Candidate]) -> list[str]:
    """--rotate auto (the export's default): no rotation, and where some candidate has 8-bit
    weights also the rotation the export's auto gives a recipe of only those (config.rotation)."""
    if rotate_flag != "auto":
        return [rotate_flag]
    eight_bit = [c for c in candidates if c.weight_bits == 8]
    if not eight_bit:
        return ["none"]
    return ["none", "hadamard-ffn" if all(c.backend == "xnnpack" for c in eight_bit) else "hadamard"]


def read_inputs(args) -> Inputs:
    candidates = parse_candidates(args.candidates)
    embedding = parse_embedding(args.embedding)
    measured_uniform = uniform_candidates(args, candidates)
    if any(c.backend == "qnn" and c.precision != "fp16" for c in candidates):
        qnn_host.activate()
    text = read_text(args.text)
    if not text.strip():
        raise UserError(f"--text {args.text} is empty: the measurements need real text")
    loaded = load_checkpoint(args.checkpoint, args.params)
    tokenizer = tokenizer_for_model(loaded.tokenizer_path, loaded.args.vocab_size)
    if tokenizer is None:
        raise UserError("composite.tune reads a text: this checkpoint has no tokenizer beside it")
    bos = prompt_bos_id(loaded, tokenizer)
    groups = plan_groups(loaded.args, args.shards)
    return Inputs(candidates, embedding, measured_uniform, text, loaded, tokenizer, bos, groups)


def smallest_bytes(args, inputs: Inputs, rotation: str) -> int:
    return sum(
        min(
            group_bytes(g, c, inputs.loaded.args, args.group_size, rotation)[0]
            for c in choices_for(g, inputs.candidates, inputs.embedding)
        )
        for g in inputs.groups
    )


@dataclasses.dataclass
class Measuring:
    """One rotation's search before its measurements: what measures its model (rotated as `rotation`
    says, a model of its own), and the cache of its measurements."""

    rotation: str
    sens: Sensitivity
    cache: ResultCache


def measuring(args, inputs: Inputs, rotation: str) -> Measuring:
    model = inputs.loaded.part(True, range(inputs.loaded.args.n_layers), True).eval()
    rotate(model, rotation)
    groups, ctx = inputs.groups, args.ctx or args.max_seq_len
    cache = ResultCache(cache_folder(args), measurement_settings(args, inputs, model, rotation))
    sens = Sensitivity(
        model, groups, inputs.tokenizer, inputs.bos, inputs.text, ctx, args.limit_tokens, args.score,
        args.max_seq_len, args.prefill_len, args.group_size, args.soc,
    )  # fmt: skip
    return Measuring(rotation, sens, cache)


def search(args, inputs: Inputs, m: Measuring, measured: dict) -> Search:
    """From one rotation's measured choices: search the frontier, measure the chosen and the
    asked-for uniform recipes whole."""
    groups, sens, cache = inputs.groups, m.sens, m.cache
    per_group = options_per_group(
        groups, inputs.candidates, inputs.embedding, measured, inputs.loaded.args, args.group_size, m.rotation
    )
    recipes = frontier(per_group)
    chosen = best_within(recipes, int(args.budget_mb * MB))  # the smallest recipe fits: checked
    uniform = uniform_recipes(groups, per_group, inputs.candidates, inputs.embedding)
    uniform_whole = {
        label: measure_whole(sens, cache, groups, recipe)
        for label, recipe in uniform.items()
        if label.split(" + ")[0] in inputs.measured_uniform
    }
    whole = measure_whole(sens, cache, groups, chosen)
    return Search(m.rotation, sens, measured, per_group, recipes, chosen, whole, uniform, uniform_whole)


def measurement_settings(args, inputs: Inputs, model, rotation: str) -> dict:
    """Everything a measured KLD depends on: the measurement cache's key."""
    return {
        "versions": versions(),
        # the code that measures (the command line, __main__.py, only parses and prints)
        "source": shard_cache.source_fingerprint(excluded=("bench", "__main__.py")),
        "model": shard_cache.tensors_digest(model),
        "tokenizer": sha256_file(inputs.tokenizer.path),
        "bos": inputs.bos,
        "text": hashlib.sha256(inputs.text.encode()).hexdigest(),
        "ctx": args.ctx or args.max_seq_len,
        "limit_tokens": args.limit_tokens,
        "score": args.score,
        "max_seq_len": args.max_seq_len,
        "prefill_len": args.prefill_len,
        "group_size": args.group_size,
        "soc": args.soc,
        "rotate": rotation,
        "groups": [[g.kind, g.layer_start, g.layer_end] for g in inputs.groups],
    }


def measure_whole(sens: Sensitivity, cache: ResultCache, groups: list[Group], recipe: Recipe) -> dict:
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


def header(args, best: Search) -> list[str]:
    chosen, whole = best.chosen, best.whole
    return [
        f"composite.tune: lowest predicted KLD within {args.budget_mb:g} MB over {args.candidates}",
        f"checkpoint {args.checkpoint or '(embedded default)'}, text {args.text}, "
        f"{best.sens.scored_tokens} tokens scored, rotation {best.rotation}",
        f"weights {chosen.bytes / MB:.2f} MB; predicted KLD {kld_text(chosen.kld)} (sum of groups), "
        f"measured as a whole in PyTorch {kld_text(whole['kld'])}, top-1 {100 * whole['top1']:.1f}%",
    ]


def verify_chosen(args, best: Search, output: Path) -> dict:
    has_qnn = any(isinstance(c, Candidate) and c.backend == "qnn" for c in best.chosen.choices().values())
    ctx = args.ctx or args.max_seq_len
    verified = verify(args, output, has_qnn, ctx, args.verify_limit_tokens or args.limit_tokens)
    if args.verify_limit_tokens:
        # the PyTorch figure on the tokens the export was measured on, beside the export's
        same_tokens = best.sens.evaluate(best.chosen.choices(), chunk_count=args.verify_limit_tokens // ctx)
        verified["kld_whole_same_tokens"] = same_tokens["kld"]
    return verified


def summary(best: Search, searches: list[Search], verified: dict | None, output: Path, plot_path: Path) -> dict:
    chosen, measured = best.chosen, best.measured
    return {
        "rotation": best.rotation,
        "rotations": {
            s.rotation: {"recipe": describe(s.chosen), "mb": round(s.chosen.bytes / MB, 3), "kld_whole": s.whole["kld"]}
            for s in searches
        },
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
            for g, options in zip(best.sens.groups, best.per_group)
        ],
        "frontier": [{"mb": round(r.bytes / MB, 3), "kld": r.kld, "recipe": describe(r)} for r in best.recipes],
        "uniform": {
            label: {
                "mb": round(r.bytes / MB, 3),
                "decode_mb": round(r.decode_bytes / MB, 3),
                "kld_predicted": r.kld,
                **(
                    {"kld_whole": best.uniform_whole[label]["kld"], "top1_whole": best.uniform_whole[label]["top1"]}
                    if label in best.uniform_whole
                    else {}
                ),
            }
            for label, r in best.uniform.items()
        },
        "chosen": {
            "recipe": describe(chosen),
            "mb": round(chosen.bytes / MB, 3),
            "decode_mb": round(chosen.decode_bytes / MB, 3),
            "kld_predicted": chosen.kld,
            "kld_whole": best.whole["kld"],
            "top1_whole": best.whole["top1"],
        },
        "verified": verified,
        "scored_tokens": best.sens.scored_tokens,
        "config": str(output),
        "plot": str(plot_path),
    }
