"""The steps of composite.tune (its CLI, __main__.py, parses and reports): read the inputs; build
each searched rotation's model; measure every group's choices (measure.py; every rotation's in one
run on a cluster); for each rotation search the frontier (search.py) and measure the chosen recipe
whole; keep the better rotation; write the config and its plot (output.py); verify by export
(verify.py).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from pathlib import Path

from composite import qnn_host
from composite.config import auto_rotation
from composite.errors import UserError
from composite.eval.scoring import read_text
from composite.model.checkpoint import load_checkpoint
from composite.model.rotation import rotate
from composite.tokenizer import prompt_bos_id, tokenizer_for_model
from composite.tune.cache import ResultCache, cache_folder, measurement_settings
from composite.tune.candidates import (
    Candidate,
    Group,
    choice_name,
    choices_for,
    group_bytes,
    parse_candidates,
    parse_embedding,
    plan_groups,
    table_stored_once,
)
from composite.tune.measure import Rotated, measure_sensitivities, measure_whole
from composite.tune.output import header, plot, summary, tuned_config, write_config
from composite.tune.search import Option, Recipe, best_within, frontier
from composite.tune.sensitivity import Sensitivity
from composite.tune.verify import verify_chosen
from composite.units import MB


def options_per_group(inputs, measured, model_args, group_size, rotation, qnn_block) -> list[list[Option]]:
    out = []
    for group in inputs.groups:
        options = []
        for choice in inputs.choices(group):
            stored, read = group_bytes(group, choice, model_args, group_size, rotation, qnn_block)
            options.append(
                Option(group.index, choice, stored, read, measured[(group.index, choice_name(choice))]["kld"])
            )
        out.append(options)
    return out


def uniform_recipes(
    groups, per_group: list[list[Option]], candidates, embedding, head, stored_once
) -> dict[str, Recipe]:
    """Every group at one candidate, for each embedding choice (the head at the first --head
    choice where the candidate is not one). stored_once(first, last) as frontier's."""
    out = {}
    for candidate in candidates:
        for emb in embedding:
            chosen = []
            for group, options in zip(groups, per_group):
                wanted = emb if group.kind == "embedding" else candidate
                if group.kind == "head" and candidate not in head:
                    wanted = head[0]
                chosen.append(next(o for o in options if o.choice == wanted))
            label = candidate.name + ("" if emb == "none" else f" + embedding {emb}")
            out[label] = Recipe(tuple(chosen), stored_once(chosen[0], chosen[-1]))
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


@dataclasses.dataclass
class Inputs:
    """What every rotation's search shares: the choices, the text, the checkpoint and its tokenizer."""

    candidates: list[Candidate]
    embedding: list[str]
    head: list[Candidate]  # the head's candidates (--head, default the candidates)
    measured_uniform: set[str]  # the candidates whose uniform recipes are measured whole
    text: str
    loaded: object  # LoadedModel
    tokenizer: object
    bos: int | None
    groups: list[Group]

    def choices(self, group: Group) -> list:
        return choices_for(group, self.candidates, self.embedding, self.head)

    def pairs(self) -> list:
        """Every (group, choice) the search measures."""
        return [(g, c) for g in self.groups for c in self.choices(g)]


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
    models = [rotated(args, inputs, rotation) for rotation in fitting]
    measured = measure_sensitivities(models, inputs.pairs(), executor)
    searches = [search(args, inputs, m, found) for m, found in zip(models, measured)]
    best = min(searches, key=lambda s: s.whole["kld"])  # the better at the budget, each measured whole
    output = Path(args.output)
    write_config(output, tuned_config(args, inputs.groups, best.chosen, best.rotation), header(args, best))
    plot_path = Path(args.plot or output.with_suffix(".png"))
    plot(plot_path, best.recipes, best.uniform, best.chosen, args.budget_mb)
    verified = verify_chosen(args, best, output) if args.verify else None
    return summary(best, searches, verified, output, plot_path)


def rotations_to_search(rotate_flag: str, candidates: list[Candidate]) -> list[str]:
    """--rotate auto (the export's default): no rotation, and where some candidate is one the
    export's auto rotates also the rotation it gives a recipe of only those (config.auto_rotation)."""
    if rotate_flag != "auto":
        return [rotate_flag]
    rotated = [(c.backend, c.precision) for c in candidates if auto_rotation([(c.backend, c.precision)]) != "none"]
    return ["none", auto_rotation(rotated)] if rotated else ["none"]


def read_inputs(args) -> Inputs:
    candidates = parse_candidates(args.candidates)
    embedding = parse_embedding(args.embedding)
    head = parse_candidates(args.head) if args.head else candidates
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
    return Inputs(candidates, embedding, head, measured_uniform, text, loaded, tokenizer, bos, groups)


def smallest_bytes(args, inputs: Inputs, rotation: str) -> int:
    """The smallest recipe's bytes: the frontier's one recipe when every option costs nothing."""
    free = collections.defaultdict(lambda: {"kld": 0.0})
    options = options_per_group(inputs, free, inputs.loaded.args, args.group_size, rotation, args.qnn_block_size)
    return frontier(options, table_saving(inputs.loaded.args, rotation))[0].bytes


def table_saving(model_args, rotation: str) -> Callable[[Option, Option], int]:
    """stored_once(embedding option, head option) for frontier: what the tied table stored once saves."""
    return lambda embedding, head: table_stored_once(embedding.choice, head.choice, model_args, rotation)


def rotated(args, inputs: Inputs, rotation: str) -> Rotated:
    """The model rotated as `rotation` says (a model of its own) and what measures it."""
    model = inputs.loaded.part(True, range(inputs.loaded.args.n_layers), True).eval()
    rotate(model, rotation)
    groups, ctx = inputs.groups, args.ctx or args.max_seq_len
    cache = ResultCache(cache_folder(args), measurement_settings(args, inputs, model, rotation))
    sens = Sensitivity(
        model=model,
        groups=groups,
        tokenizer=inputs.tokenizer,
        bos_id=inputs.bos,
        text=inputs.text,
        ctx=ctx,
        limit_tokens=args.limit_tokens,
        score=args.score,
        max_seq_len=args.max_seq_len,
        prefill_len=args.prefill_len,
        group_size=args.group_size,
        soc=args.soc,
        qnn_options={"block_size": args.qnn_block_size},
    )
    return Rotated(rotation, sens, cache)


def search(args, inputs: Inputs, m: Rotated, measured: dict) -> Search:
    """From one rotation's measured choices: search the frontier, measure the chosen and the
    asked-for uniform recipes whole."""
    groups, sens, cache = inputs.groups, m.sens, m.cache
    per_group = options_per_group(
        inputs, measured, inputs.loaded.args, args.group_size, m.rotation, args.qnn_block_size
    )
    stored_once = table_saving(inputs.loaded.args, m.rotation)
    recipes = frontier(per_group, stored_once)
    chosen = best_within(recipes, int(args.budget_mb * MB))  # the smallest recipe fits: checked
    uniform = uniform_recipes(groups, per_group, inputs.candidates, inputs.embedding, inputs.head, stored_once)
    uniform_whole = {
        label: measure_whole(sens, cache, groups, recipe)
        for label, recipe in uniform.items()
        if label.split(" + ")[0] in inputs.measured_uniform
    }
    whole = measure_whole(sens, cache, groups, chosen)
    return Search(m.rotation, sens, measured, per_group, recipes, chosen, whole, uniform, uniform_whole)
