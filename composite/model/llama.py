"""Static-shape LLaMA (Llama 2 and Llama 3 / 3.2) with the KV cache as explicit graph I/O.

The decoder layers never own a cache. Each takes its layer's cache tensors as inputs and returns the
entries for the current positions; the runner owns the cache and writes those entries into it.

Cache layout (one source of truth: `cache_shapes`):
  k cache [n_kv_heads, head_dim, max_seq_len]  (sequence last, so q @ k needs no transpose)
  v cache [n_kv_heads, max_seq_len, head_dim]
New entries for T tokens come back as k [n_kv_heads, head_dim, T] and v [n_kv_heads, T, head_dim].
Three dimensions, so attention is a plain batched matmul over the KV heads: a 4-D matmul would be
lowered as expand + reshape + bmm, and both copy the whole cache on every call.

Attention runs over the S cached slots plus the T new tokens. The additive mask [T, S + T] is an
input, so the runner alone decides which cache slots are valid; the scores against the cache and
against the new tokens are computed separately so the cache is never concatenated (copied).

Rotary embeddings use the rotate-half convention (Hugging Face layout); Meta checkpoints are
permuted into it when loaded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    head_dim: int = 0  # 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, {"type": "linear", "factor": f}, {"type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} or {"type": "factors", "factors":
    # [one divisor per frequency]} (GGUF's rope_freqs, llama.cpp's freq_factors)
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], with Llama 3 / linear scaling applied."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    if scaling["type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["type"] == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def _project(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        """Static-cache step (batch 1): returns (output, new k entries, new v entries)."""
        b, t, _ = x.shape
        kv, hd = self.n_kv_heads, self.head_dim
        rep = self.n_heads // kv
        s = k_cache.shape[-1]
        q, k, v = self._project(x, cos, sin)
        # Heads h = g * rep + r share kv group g: fold the group's heads into rows so the
        # batched matmul reads each cache once instead of repeating it per head.
        q = q.reshape(kv, rep * t, hd) * (1.0 / math.sqrt(hd))
        k_new = k.reshape(kv, t, hd).transpose(1, 2)  # [kv, hd, t]
        v_new = v.reshape(kv, t, hd)
        scores = torch.cat((torch.bmm(q, k_cache), torch.bmm(q, k_new)), dim=-1).view(kv, rep, t, s + t) + mask
        probs = torch.softmax(scores, dim=-1).view(kv, rep * t, s + t)
        out = torch.bmm(probs[..., :s], v_cache) + torch.bmm(probs[..., s:], v_new)
        out = out.view(b, self.n_heads, t, hd).transpose(1, 2).reshape(b, t, self.n_heads * hd)
        return self.wo(out), k_new, v_new

    def forward_full(self, x, cos, sin):
        """Plain causal attention over the whole sequence: the reference path, no cache."""
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class KroneckerRotation(nn.Module):
    """x -> x (A kron B) for x [..., a * b]: an orthogonal mix of the last dimension computed as
    two small matmuls, B within blocks of b and A across the a blocks, instead of one dense
    [a*b, a*b] matrix (composite/model/rotation.py makes A and B and folds the inverse into w2)."""

    def __init__(self, across: torch.Tensor, within: torch.Tensor):
        super().__init__()
        # F.linear with buffers, not nn.Linear: XNNPACK's quantizer (quantize_linears) leaves them in
        # float; QNN's gives them 16-bit weights (lowering/qnn/quantizer.py).
        self.register_buffer("across_t", across.T.contiguous())
        self.register_buffer("within_t", within.T.contiguous())

    def forward(self, x):
        a, b = self.across_t.shape[0], self.within_t.shape[0]
        y = F.linear(x.reshape(*x.shape[:-1], a, b), self.within_t)  # [..., a, b]
        y = F.linear(y.transpose(-1, -2), self.across_t).transpose(-1, -2)
        return y.reshape(x.shape)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.hidden_rotation: KroneckerRotation | None = None  # rotate "hadamard-ffn" sets it

    def forward(self, x):
        return self.down(F.silu(self.w1(x)) * self.w3(x))

    def down(self, hidden):
        if self.hidden_rotation is not None:
            hidden = self.hidden_rotation(hidden)
        return self.w2(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        attn, k_new, v_new = self.attention(self.attention_norm(x), cos, sin, mask, k_cache, v_cache)
        h = x + attn
        return h + self.feed_forward(self.ffn_norm(h)), k_new, v_new

    def forward_full(self, x, cos, sin):
        h = x + self.attention.forward_full(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model. Parameter names follow Meta's checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @torch.no_grad()
    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Eager reference: logits [1, T, vocab] for every position of `tokens` [1, T]."""
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(tokens.shape[1]))
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer.forward_full(h, cos, sin)
        return self.output(self.norm(h))


def cache_shapes(args: ModelArgs, max_seq_len: int) -> tuple[list[int], list[int]]:
    """Shapes of one layer's k and v cache."""
    return (
        [args.n_kv_heads, args.head_dim, max_seq_len],
        [args.n_kv_heads, max_seq_len, args.head_dim],
    )


def new_entry_shapes(args: ModelArgs, n_tokens: int) -> tuple[list[int], list[int]]:
    """Shapes of one layer's new k and v entries for `n_tokens` positions."""
    return cache_shapes(args, n_tokens)
