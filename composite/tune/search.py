"""The search: one choice per group, the lowest predicted KLD within a size budget.

The predicted KLD of a recipe is the sum of its groups' KLDs, each measured with only that group
changed (the first model; composite.tune checks it against the recipe measured as a whole). Under
that model the problem is a multiple-choice knapsack, solved exactly by merging the groups one at a
time and keeping only the Pareto-optimal partial recipes (no smaller recipe has a lower KLD).

Sizes add up too, but for one pair: a tied table's lookup and head can be stored once
(lowering/shared_table.py), so the first and last groups' bytes depend on each other. They are
merged first, as one group of pairs whose bytes take off what is stored once; the rest add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    group: int  # the group's index
    choice: object  # a Candidate, or an embedding_quantize string
    bytes: int
    decode_bytes: int
    kld: float


@dataclass(frozen=True)
class Recipe:
    options: tuple[Option, ...]  # in group order
    saved: int = 0  # bytes stored once: the tied table, when its lookup and head share it

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.options) - self.saved

    @property
    def decode_bytes(self) -> int:
        return sum(o.decode_bytes for o in self.options)

    @property
    def kld(self) -> float:
        return sum(o.kld for o in self.options)

    def choices(self) -> dict[int, object]:
        return {o.group: o.choice for o in self.options}


def frontier(
    options_per_group: list[list[Option]], stored_once: Callable[[Option, Option], int] | None = None
) -> list[Recipe]:
    """Every Pareto-optimal recipe (one option per group), smallest first. stored_once(first,
    last): the bytes a recipe saves with those options for its first and last groups."""
    groups = list(options_per_group)
    partial: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    if stored_once is not None and len(groups) > 1:  # the pair first, as one group whose sizes do not add
        first, last = groups.pop(0), groups.pop()
        partial = pareto([(a.bytes + b.bytes - stored_once(a, b), a.kld + b.kld, (a, b)) for a in first for b in last])
    for options in groups:
        partial = pareto(
            [(size + o.bytes, kld + o.kld, chosen + (o,)) for size, kld, chosen in partial for o in options]
        )
    recipes = []
    for size, _, chosen in partial:
        ordered = tuple(sorted(chosen, key=lambda o: o.group))
        recipes.append(Recipe(ordered, sum(o.bytes for o in ordered) - size))
    return recipes


def pareto(items: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    """The (size, kld, options) items that no smaller or equal one beats on KLD, smallest first."""
    kept, best = [], float("inf")
    for item in sorted(items, key=lambda item: (item[0], item[1])):
        if item[1] < best:
            kept.append(item)
            best = item[1]
    return kept


def best_within(recipes: list[Recipe], budget_bytes: int) -> Recipe | None:
    """The frontier's lowest-KLD recipe of at most budget_bytes (the frontier is sorted by size,
    so its KLD falls as size grows)."""
    fitting = [r for r in recipes if r.bytes <= budget_bytes]
    return fitting[-1] if fitting else None


def thinned(rows: list, count: int) -> list:
    """At most `count` of `rows` (sorted by size), evenly spaced by position, both ends kept."""
    if len(rows) <= count:
        return rows
    picked = sorted({round(i * (len(rows) - 1) / (count - 1)) for i in range(count)})
    return [rows[i] for i in picked]
