"""composite.tune's measurements: the KLD of each (group, choice), in two processes here or as jobs
on a cluster, and of whole recipes, each kept in the rotation's cache."""

from __future__ import annotations

import dataclasses
import sys

from composite.executor import Job
from composite.executor.fork import ForkedCall, split_work
from composite.runtime.threads import one_thread
from composite.tune.cache import ResultCache
from composite.tune.candidates import Candidate, Group, choice_name
from composite.tune.output import describe, kld_text
from composite.tune.search import Recipe
from composite.tune.sensitivity import Sensitivity


@dataclasses.dataclass
class Rotated:
    """One rotation of the model: what measures it (a Sensitivity of the model rotated as
    `rotation` says) and the cache of its measurements."""

    rotation: str
    sens: Sensitivity
    cache: ResultCache


def measure_cost(group: Group, choice) -> float:
    """A rough share of the measuring time, to split the work between two processes: a QNN
    quantized candidate is traced, calibrated and run as a fake-quantized graph, fp16 runs in half
    precision, XNNPACK's run torchao's eager kernels; the head costs about three layers."""
    if group.kind == "embedding":
        return 0.2
    size = 3.0 if group.kind == "head" else group.layer_end - group.layer_start
    if isinstance(choice, Candidate) and choice.backend == "qnn":
        return size * (3.0 if choice.quantized_qnn else 2.0)
    return size


def measure(sens: Sensitivity, pairs: list) -> dict:
    """(group index, choice name) -> {"kld", "top1", "seconds"} for `pairs`, measured here, on one
    thread (the figures do not depend on where they are measured: here, a forked process, a Ray
    worker)."""
    with one_thread():
        calibrated = [(g, c) for g, c in pairs if isinstance(c, Candidate) and c.quantized_qnn]
        if calibrated:
            print(f"calibrating {len(calibrated)} quantized QNN graphs ...", file=sys.stderr, flush=True)
            sens.prepare_qnn(calibrated)
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


def measure_sensitivities(searches: list[Rotated], pairs: list, executor=None) -> list[dict]:
    """For each rotation's search: (group index, choice name) -> {"kld", "top1", "seconds", "cached"}.
    What its cache does not hold is measured in two processes (a fork of this one takes about half
    of the groups, each process builds and calibrates its own groups' QNN graphs): measuring is
    mostly one thread of Python and small tensors, which leaves the second core of a small machine
    idle otherwise. executor (--ray): each (group, choice) of every search a job of its own, all in
    one run on the cluster, so that its workers start and import torch once, not once per search."""

    def key(group, choice) -> str:
        return f"{group.name}|{choice_name(choice)}"

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
        groups = list(dict.fromkeys(g for g, _ in pairs))
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


def measure_whole(sens: Sensitivity, cache: ResultCache, groups: list[Group], recipe: Recipe) -> dict:
    key = "whole|" + describe(recipe)
    if cache.get(key) is None:
        qnn = [
            (groups[o.group], o.choice)
            for o in recipe.options
            if isinstance(o.choice, Candidate) and o.choice.quantized_qnn
        ]
        sens.prepare_qnn(qnn)
        cache.put(key, sens.evaluate(recipe.choices()))
    return cache.get(key)
