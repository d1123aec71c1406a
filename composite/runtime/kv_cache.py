"""The KV cache the runner owns, and the attention mask that says which of its slots are valid."""

from __future__ import annotations

import torch

from composite.runtime.context_shift import rotate_keys


class KVCache:
    """One k and one v tensor per layer, shaped as the manifest's kv_cache says, updated in place.
    encodings: per layer, the (k, v) Encoding of its cache, or None for float32."""

    def __init__(self, n_layers: int, k_shape: list[int], v_shape: list[int], encodings: list | None = None):
        self.encodings = encodings or [(None, None)] * n_layers
        self.k = [self._empty(k_shape, k) for k, _ in self.encodings]
        self.v = [self._empty(v_shape, v) for _, v in self.encodings]

    @staticmethod
    def _empty(shape: list[int], encoding) -> torch.Tensor:
        # An empty slot holds zero: the zero point of a quantized cache.
        if encoding is None:
            return torch.zeros(shape, dtype=torch.float32)
        return torch.full(shape, encoding.empty_value, dtype=encoding.dtype)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, pos: int, count: int) -> None:
        """Store the first `count` new entries (k [kv,hd,T], v [kv,T,hd]) at slots pos.. (new
        entries come in the cache's own encoding)."""
        self.k[layer][:, :, pos : pos + count] = k_new[:, :, :count]
        self.v[layer][:, pos : pos + count, :] = v_new[:, :count, :]

    def shift(self, keep: int, evict: int, used: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Context shift (composite/runtime/context_shift.py): slots keep+evict .. used-1 move down
        to keep .. used-evict-1, their keys rotated by the angle of cos/sin [head_dim/2] in float32
        and re-encoded in the layer's encoding; the freed slots are emptied."""
        moved, to = slice(keep + evict, used), slice(keep, used - evict)
        freed = slice(used - evict, used)
        for layer, (k_encoding, v_encoding) in enumerate(self.encodings):
            k, v = self.k[layer], self.v[layer]
            keys = k[:, :, moved].to(torch.float32) if k_encoding is None else k_encoding.decode(k[:, :, moved])
            rotated = rotate_keys(keys, cos, sin)
            k[:, :, to] = rotated if k_encoding is None else k_encoding.encode(rotated)
            v[:, to] = v[:, moved].clone()  # the ranges overlap
            k[:, :, freed] = 0 if k_encoding is None else k_encoding.empty_value
            v[:, freed] = 0 if v_encoding is None else v_encoding.empty_value

    def reset(self) -> None:
        for layer, (k, v) in enumerate(self.encodings):
            self.k[layer].fill_(0 if k is None else k.empty_value)
            self.v[layer].fill_(0 if v is None else v.empty_value)


class AttentionMask:
    """Additive mask [T, max_seq_len + T] for a method of T tokens per call.

    Cache columns are visible below the current position; the call's own T columns are causal.
    Kept per method and updated in place: only the cache columns change between calls.
    """

    def __init__(self, n_tokens: int, max_seq_len: int, hidden: float):
        self.max_seq_len, self.hidden = max_seq_len, hidden
        self.tensor = torch.full((n_tokens, max_seq_len + n_tokens), hidden, dtype=torch.float32)
        causal = torch.full((n_tokens, n_tokens), hidden).triu(1)
        self.tensor[:, max_seq_len:] = causal
        self.visible_until = 0

    def at(self, pos: int) -> torch.Tensor:
        """The mask for a call whose first token sits at position `pos`."""
        if pos > self.visible_until:
            self.tensor[:, self.visible_until : pos] = 0.0
        elif pos < self.visible_until:
            self.tensor[:, pos : self.visible_until] = self.hidden
        self.visible_until = pos
        return self.tensor

    def tree(self, pos: int, visible: torch.Tensor) -> torch.Tensor:
        """The mask for a verify call at `pos` whose own rows see what `visible` [T, T] says."""
        self.at(pos)
        self.tensor[:, self.max_seq_len :] = torch.where(visible, 0.0, self.hidden)
        return self.tensor
