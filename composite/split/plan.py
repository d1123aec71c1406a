"""Where to cut: which decoder layers each shard owns.

The model is a chain of units: [embedding, layer 0 .. layer L-1, head (final norm + output)].
Shard 0 always owns the embedding and the last shard the head, so N shards are N contiguous,
non-empty groups of that chain: 1 <= N <= L + 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from composite.errors import UserError
from composite.model.llama import ModelArgs


@dataclass(frozen=True)
class ShardSpec:
    index: int
    layer_start: int  # first decoder layer owned (inclusive)
    layer_end: int  # one past the last decoder layer owned
    has_embedding: bool
    has_head: bool

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def unit_bytes(args: ModelArgs) -> list[int]:
    """Parameter bytes (fp32) of each unit of the chain, embedding first, head last."""
    d, hd = args.dim, args.head_dim
    attention = d * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    layer = attention + 3 * d * args.hidden_dim + 2 * d
    embedding = args.vocab_size * d
    head = args.vocab_size * d + d
    return [4 * embedding] + [4 * layer] * args.n_layers + [4 * head]


def _balanced_cuts(weights: list[int], n: int) -> list[int]:
    """Split `weights` into n contiguous non-empty groups minimising the heaviest group.

    Returns the group sizes. Ties go to the earliest cut, which keeps results stable.
    """
    count = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-group weight splitting the first i units into k groups.
    best = [[inf] * (count + 1) for _ in range(n + 1)]
    cut = [[0] * (count + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, count - (n - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], count
    for k in range(n, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def plan_shards(args: ModelArgs, n_shards: int, layers_per_shard: list[int] | None = None) -> list[ShardSpec]:
    n_layers = args.n_layers
    if n_shards < 1 or n_shards > n_layers + 2:
        raise UserError(
            f"{n_shards} shards is out of range: this model has {n_layers} layers, so 1 to "
            f"{n_layers + 2} shards (embedding alone, one layer each, head alone)"
        )
    if layers_per_shard is not None:
        counts = list(layers_per_shard)
        if len(counts) != n_shards:
            raise UserError(f"layers_per_shard has {len(counts)} entries but there are {n_shards} shards")
        if any(c < 0 for c in counts) or sum(counts) != n_layers:
            raise UserError(f"layers_per_shard {counts} must be non-negative and sum to the model's {n_layers} layers")
        for i in range(1, n_shards - 1):
            if counts[i] == 0:
                raise UserError(f"layers_per_shard {counts}: middle shard {i} would own nothing")
        if n_shards > 1 and counts[0] == 0 and counts[-1] == 0 and n_layers == 0:
            raise UserError("a model without layers cannot be split")
    else:
        sizes = _balanced_cuts(unit_bytes(args), n_shards)
        counts = list(sizes)
        counts[0] -= 1  # the embedding unit
        counts[-1] -= 1  # the head unit
        if n_shards == 1:
            counts = [n_layers]
    specs, start = [], 0
    for i, count in enumerate(counts):
        specs.append(ShardSpec(i, start, start + count, has_embedding=i == 0, has_head=i == n_shards - 1))
        start += count
    return specs


def auto_layer_counts(args: ModelArgs, capacity: list[int | None]) -> list[int]:
    """Layers per shard when the NPU shards' size decides the cut (`layers_per_shard: auto`).
    capacity: per shard, the most layers it can hold (a QNN shard within its HTP budget), or None
    for a CPU shard. The decoder layers go to the NPU shards first, as many as they hold, spread
    evenly over them; what they cannot hold goes to the CPU shards, each next layer to the one
    with the fewest bytes so far (the embedding's and the head's count), so the CPU shards are
    balanced. A middle shard gets at least one layer."""
    n, n_layers = len(capacity), args.n_layers
    middle = [0 < i < n - 1 for i in range(n)]
    npu = [i for i, c in enumerate(capacity) if c is not None]
    cpu = [i for i, c in enumerate(capacity) if c is None]
    for i in npu:
        if middle[i] and capacity[i] < 1:
            raise UserError(f"one decoder layer alone does not fit NPU shard {i}'s budget (qnn.max_context_mb)")
    counts = [0] * n
    cpu_first = [i for i in cpu if middle[i]]
    to_npu = min(sum(capacity[i] for i in npu), n_layers - len(cpu_first))
    for _ in range(to_npu):
        room = [i for i in npu if counts[i] < capacity[i]]
        counts[min(room, key=lambda i: (counts[i], i))] += 1
    for i in cpu_first:
        counts[i] = 1
    rest = n_layers - sum(counts)
    if rest and not cpu:
        raise UserError(
            f"the NPU shards hold at most {sum(capacity[i] for i in npu)} of the model's {n_layers} layers within "
            "their budget (qnn.max_context_mb): add shards, or raise the budget"
        )
    units = unit_bytes(args)
    load = {i: units[0] * (i == 0) + units[-1] * (i == n - 1) + counts[i] * units[1] for i in cpu}
    for _ in range(rest):
        i = min(cpu, key=lambda j: (load[j], j))
        counts[i] += 1
        load[i] += units[1]
    return counts
