"""The search: one choice per group, the lowest predicted KLD within a size budget.

The predicted KLD of a recipe is the sum of its groups' KLDs, each measured with only that group
changed (the first model; composite.tune checks it against the recipe measured as a whole). Under
that model the problem is a multiple-choice knapsack, solved exactly by merging the groups one at a
time and keeping only the Pareto-optimal partial recipes (no smaller recipe has a lower KLD).
"""

from __future__ import annotations

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
    options: tuple[Option, ...]

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.options)

    @property
    def decode_bytes(self) -> int:
        return sum(o.decode_bytes for o in self.options)

    @property
    def kld(self) -> float:
        return sum(o.kld for o in self.options)

    def choices(self) -> dict[int, object]:
        return {o.group: o.choice for o in self.options}


def frontier(options_per_group: list[list[Option]]) -> list[Recipe]:
    """Every Pareto-optimal recipe (one option per group), smallest first."""
    partial: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    for options in options_per_group:
        merged = sorted(
            ((size + o.bytes, kld + o.kld, chosen + (o,)) for size, kld, chosen in partial for o in options),
            key=lambda item: (item[0], item[1]),
        )
        partial, best = [], float("inf")
        for item in merged:
            if item[1] < best:
                partial.append(item)
                best = item[1]
    return [Recipe(chosen) for _, _, chosen in partial]


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
