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
  logits_index  [1] int64, the row of the last real token: the head shard's multi-token methods
Outputs: x, then k_new.L, v_new.L per layer; the first `count` entries go to slots pos.. .
"""

from __future__ import annotations

import torch


def padded_tokens(tokens, width: int) -> torch.Tensor:
    """The embedding shard's input: `tokens` then zeros up to the method's width."""
    return torch.tensor([list(tokens) + [0] * (width - len(tokens))], dtype=torch.int64)


def last_row(count: int) -> torch.Tensor:
    """logits_index of a call whose `count` first rows are real."""
    return torch.tensor([count - 1], dtype=torch.int64)


def call_inputs(x, pos: int, width: int, mask, caches=(), logits_index=None) -> list:
    """The inputs of one call. caches: (k, v) of each of the shard's layers, in order (none for a
    shard without layers, which takes no positions or mask either); logits_index: the head
    shard's row tensor for a method wider than 1, else None."""
    inputs = [x]
    if caches:
        inputs += [torch.arange(pos, pos + width, dtype=torch.int64), mask]
        for k, v in caches:
            inputs += [k, v]
    if logits_index is not None:
        inputs.append(logits_index)
    return inputs


def write_new_entries(cache, layers, outputs: list, pos: int, count: int) -> None:
    """The first `count` new entries of each layer in `layers` (the cache's indices of the
    shard's layers, in order) from a call's outputs into `cache` at slots pos.. ."""
    for i, layer in enumerate(layers):
        cache.write(layer, outputs[1 + 2 * i], outputs[2 + 2 * i], pos, count)
