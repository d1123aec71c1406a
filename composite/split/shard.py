"""A shard as an nn.Module with a flat, static tensor interface, plus the description of that
interface (names, shapes, dtypes) that goes into the manifest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from composite.model.llama import Transformer, cache_shapes, new_entry_shapes, rope_cos_sin
from composite.split.plan import ShardSpec


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def example(self) -> torch.Tensor:
        if self.dtype == torch.int64:
            return torch.zeros(self.shape, dtype=self.dtype)
        return torch.randn(self.shape, dtype=self.dtype) * 0.1


LOGITS_INDEX = "logits_index"


def k_cache_name(layer: int) -> str:
    return f"k_cache.{layer}"


def v_cache_name(layer: int) -> str:
    return f"v_cache.{layer}"


def k_new_name(layer: int) -> str:
    return f"k_new.{layer}"


def v_new_name(layer: int) -> str:
    return f"v_new.{layer}"


def shard_io(
    model_args, spec: ShardSpec, n_tokens: int, max_seq_len: int, every_row: bool = False
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of one shard method processing `n_tokens` positions, in call order.
    every_row: the head gives every row's logits (the verify method), not one chosen row's."""
    dim = model_args.dim
    inputs: list[TensorSpec] = []
    if spec.has_embedding:
        inputs.append(TensorSpec("tokens", (1, n_tokens), torch.int64))
    else:
        inputs.append(TensorSpec("hidden", (1, n_tokens, dim), torch.float32))
    outputs: list[TensorSpec] = []
    if spec.has_head:
        # Prefill samples only its last valid token's logits: the head runs on that one row.
        rows = n_tokens if every_row else 1
        outputs.append(TensorSpec("logits", (1, rows, model_args.vocab_size), torch.float32))
    else:
        outputs.append(TensorSpec("hidden", (1, n_tokens, dim), torch.float32))
    if len(spec.layers):
        inputs.append(TensorSpec("input_pos", (n_tokens,), torch.int64))
        inputs.append(TensorSpec("mask", (n_tokens, max_seq_len + n_tokens), torch.float32))
        k_shape, v_shape = cache_shapes(model_args, max_seq_len)
        k_new, v_new = new_entry_shapes(model_args, n_tokens)
        for layer in spec.layers:
            inputs.append(TensorSpec(k_cache_name(layer), tuple(k_shape), torch.float32))
            inputs.append(TensorSpec(v_cache_name(layer), tuple(v_shape), torch.float32))
            outputs.append(TensorSpec(k_new_name(layer), tuple(k_new), torch.float32))
            outputs.append(TensorSpec(v_new_name(layer), tuple(v_new), torch.float32))
    if spec.has_head and n_tokens > 1 and not every_row:
        inputs.append(TensorSpec(LOGITS_INDEX, (1,), torch.int64))  # which of the T rows gets logits
    return inputs, outputs


class ShardModule(nn.Module):
    """Embedding (shard 0), a run of decoder layers, final norm + output (last shard).

    forward(x, [input_pos, mask, k_cache_a, v_cache_a, k_cache_a+1, ...], [logits_index]) ->
        (hidden or logits, k_new_a, v_new_a, ...)
    logits_index: the last shard's prefill only, whose logits are [1, 1, vocab]; without it
    (decode, verify) the head gives every row's logits, [1, T, vocab].
    """

    def __init__(self, model: Transformer, spec: ShardSpec):
        super().__init__()
        self.spec = spec
        self.args = model.args
        self.tok_embeddings = model.tok_embeddings if spec.has_embedding else None
        # Keyed by the model's layer index, so module paths ("layers.7.attention.wo") are the same
        # in every shard as in the checkpoint.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        self.norm = model.norm if spec.has_head else None
        self.output = model.output if spec.has_head else None
        self.register_buffer("inv_freq", model.inv_freq.clone(), persistent=False)
        self.rope = None  # a module mapping input_pos -> (cos, sin); None computes them from inv_freq

    def forward(self, x, *inputs):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        new_entries = []
        n_layer_inputs = 2 + 2 * len(self.layers) if len(self.layers) else 0
        layer_inputs, extra = inputs[:n_layer_inputs], inputs[n_layer_inputs:]
        if len(self.layers):
            input_pos, mask, *caches = layer_inputs
            cos, sin = self.rope(input_pos) if self.rope is not None else rope_cos_sin(self.inv_freq, input_pos)
            for i, layer in enumerate(self.layers.values()):
                h, k_new, v_new = layer(h, cos, sin, mask, caches[2 * i], caches[2 * i + 1])
                new_entries += [k_new, v_new]
        if self.output is not None:
            h = h.index_select(1, extra[0]) if extra else h
            h = self.output(self.norm(h))
        return (h, *new_entries)
