"""One call of one shard, as both runners make it: its inputs in the manifest's order, and its new
KV-cache entries written back (runner_cpp/shard_chain.cpp builds the same). The Python runner
(runtime/chain.py), calibration's replay of a float shard (lowering/calibration.py) and the tuner's
call-by-call graphs (tune/sensitivity.py) all call shards through here.

A call of a method `width` tokens wide, `count` of them real (the rest padding), at positions
pos .. pos+width-1:
  x             tokens [1, width] int64 (the embedding shard) or hidden [1, width, dim]
  input_pos     [width] int64                  } shards with layers only
  mask          [width, max_seq_len + width]   }
  k_cache.L, v_cache.L per layer L             }
  logits_index  [1] int64, the row of the last real token: the head shard's prefill
Outputs: x, then k_new.L, v_new.L per layer; the first `count` entries go to slots pos.. .

A verify call (runtime/speculate.py) carries a tree of tokens instead: row i at position
pos + depth of i, seeing the cache below pos and its own ancestors in the tree; the head gives
every row's logits, and only the rows of the accepted path are written to the cache, afterwards.
"""

from __future__ import annotations

import torch


def padded_tokens(tokens, width: int) -> torch.Tensor:
    """The embedding shard's input: `tokens` then zeros up to the method's width."""
    return torch.tensor([list(tokens) + [0] * (width - len(tokens))], dtype=torch.int64)


def last_row(count: int) -> torch.Tensor:
    """logits_index of a call whose `count` first rows are real."""
    return torch.tensor([count - 1], dtype=torch.int64)


def call_inputs(x, pos: int, width: int, mask, caches=(), logits_index=None, positions=None) -> list:
    """The inputs of one call. caches: (k, v) of each of the shard's layers, in order (none for a
    shard without layers, which takes no positions or mask either); logits_index: the head
    shard's row tensor for its prefill, else None; positions: [width] int64, else pos.. in order."""
    inputs = [x]
    if caches:
        if positions is None:
            positions = torch.arange(pos, pos + width, dtype=torch.int64)
        inputs += [positions, mask]
        for k, v in caches:
            inputs += [k, v]
    if logits_index is not None:
        inputs.append(logits_index)
    return inputs


def write_new_entries(cache, layers, outputs: list, pos: int, count: int, rows=None) -> None:
    """The first `count` new entries of each layer in `layers` (the cache's indices of the
    shard's layers, in order) from a call's outputs into `cache` at slots pos.. ; rows: the
    entries of these rows instead, in this order (a verify call's accepted path)."""
    for i, layer in enumerate(layers):
        k_new, v_new = outputs[1 + 2 * i], outputs[2 + 2 * i]
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.int64)
            k_new, v_new, count = k_new.index_select(2, index), v_new.index_select(1, index), len(rows)
        cache.write(layer, k_new, v_new, pos, count)


def tree_depths(parents: list[int]) -> list[int]:
    """Each row's depth in a verify call's tree (parents[i] < i, -1 for the root): its offset from
    the call's first position."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_visibility(parents: list[int], width: int) -> torch.Tensor:
    """[width, width] bool: row i sees row j (j is i or one of its ancestors); a padding row past
    the tree sees itself only."""
    seen = torch.eye(width, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen
