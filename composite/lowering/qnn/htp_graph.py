"""The HTP-friendly form of a shard, used for QNN shards only.

Same weights, same function, different graph:
- attention one KV group at a time: the group's query heads in one projection and one score
  matmul against the group's keys, their rows stacked (position-major, by a reshape), so HTP sees
  2-D matmuls and no 4-D transposes of [B, heads, T, hd] tensors (ExecuTorch's own MHA→SHA pass
  does not apply to this model and crashes the x86 simulator when it does). One head per matmul
  is the same function in more nodes, and lowering time and memory follow the node count
  (docs/scale.md, Results);
- RMSNorm as one `rms_norm` op, which QNN runs as a single RmsNorm node: a quantized graph then
  never materialises x², whose range is what breaks 16-bit fixed point;
- in quantized graphs, the additive mask clamped to [-255, 0] before it meets the scores (see
  HtpAttention);
- rotary cos/sin looked up in a precomputed table rather than computed from the position: in a
  quantized graph the angle (position x frequency) would be quantized over the positions seen in
  calibration only, and positions beyond them would get wrong rotations;
- every Linear as a 1x1 Conv2d (ExecuTorch's `convert_linear_to_conv2d`), which HTP runs faster
  and which block-quantized 4-bit weights need to pass HTP prepare.

Module paths are kept ("layers.3.attention.wo", "output") so per-layer precision overrides name the
same modules as in the checkpoint.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from composite.model.llama import Attention, RMSNorm, apply_rope, rope_cos_sin


class RopeTable(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, n_positions: int):
        super().__init__()
        cos, sin = rope_cos_sin(inv_freq, torch.arange(n_positions))
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def forward(self, input_pos):
        return self.cos_table[input_pos], self.sin_table[input_pos]


# The lowest mask value a quantized graph sees: ExecuTorch's Qualcomm llama uses the same. A
# trained model's attention scores span tens, so a masked score must sit far below the lowest
# visible one, or masked slots win in some heads (docs/placement.md).
QUANTIZED_MASK_FLOOR = -255.0


class HtpRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _split_rows(linear: nn.Linear, parts: int) -> nn.ModuleList:
    rows = linear.weight.shape[0] // parts
    heads = nn.ModuleList()
    for i in range(parts):
        head = nn.Linear(linear.in_features, rows, bias=False, device="meta")
        head.weight = nn.Parameter(linear.weight.detach()[i * rows : (i + 1) * rows].clone())
        heads.append(head)
    return heads


class HtpAttention(nn.Module):
    """Attention.forward one KV group at a time (same I/O contract): the `rep` query heads that
    share a group's keys and values are one projection, whose output [b, t, rep*hd] is viewed as
    rep*t rows of one head each (row t*rep + r: position t, head r), so one matmul scores them all.
    mask_floor: None keeps the runner's mask as it is (float16 graphs represent -30000)."""

    def __init__(self, attention: Attention, mask_floor: float | None = None):
        super().__init__()
        self.mask_floor = mask_floor
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.wq = _split_rows(attention.wq, self.n_kv_heads)
        self.wk = _split_rows(attention.wk, self.n_kv_heads)
        self.wv = _split_rows(attention.wv, self.n_kv_heads)
        self.wo = attention.wo

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        s = k_cache.shape[-1]
        rep, hd = self.n_heads // self.n_kv_heads, self.head_dim
        scale = 1.0 / math.sqrt(hd)
        # In a quantized graph the runner's "hidden" value (-30000) would stretch the quantization
        # range of the masked scores until visible scores lose their resolution.
        mask = mask.view(t, 1, s + t)
        if self.mask_floor is not None:
            mask = torch.clamp(mask, min=self.mask_floor)
        mask = mask.expand(t, rep, s + t).reshape(t * rep, s + t)
        cos_heads, sin_heads = cos.unsqueeze(1), sin.unsqueeze(1)  # [t, 1, hd/2]: the same for each head
        k_news, v_news, outputs = [], [], []
        for g in range(self.n_kv_heads):
            k = apply_rope(self.wk[g](x), cos, sin)  # [b, t, hd]
            v = self.wv[g](x)
            k_t = k.transpose(1, 2)  # [b, hd, t]
            k_news.append(k_t)
            v_news.append(v)
            q = apply_rope(self.wq[g](x).view(b, t, rep, hd), cos_heads, sin_heads).reshape(b, t * rep, hd) * scale
            scores = torch.cat((q @ k_cache[g : g + 1], q @ k_t), dim=-1) + mask
            probs = torch.softmax(scores, dim=-1)
            heads = probs[..., :s] @ v_cache[g : g + 1] + probs[..., s:] @ v  # [b, t*rep, hd]
            outputs.append(heads.reshape(b, t, rep * hd))
        out = self.wo(torch.cat(outputs, dim=-1))
        return out, torch.cat(k_news, dim=0), torch.cat(v_news, dim=0)


def htp_form(
    shard: nn.Module, n_positions: int, linear_as_conv: bool = True, mask_floor: float | None = None
) -> nn.Module:
    """A copy of `shard` in the HTP-friendly form, sharing its weights (a 3B model's shard holds
    gigabytes of them); the caller's module is left as it was.
    n_positions: how many positions the rotary table covers (cache length + widest call).
    linear_as_conv=False keeps Linear modules, e.g. when linears are to be left to XNNPACK.
    mask_floor: the lowest mask value the scores see (quantized graphs: QUANTIZED_MASK_FLOOR)."""
    from executorch.backends.qualcomm.utils.utils import convert_linear_to_conv2d

    shared = [*shard.parameters(), *shard.buffers()]
    shard = copy.deepcopy(shard, memo={id(t): t for t in shared})
    if len(shard.layers):
        shard.rope = RopeTable(shard.inv_freq, n_positions)
    for layer in shard.layers.values():
        layer.attention = HtpAttention(layer.attention, mask_floor)
        layer.attention_norm = HtpRMSNorm(layer.attention_norm)
        layer.ffn_norm = HtpRMSNorm(layer.ffn_norm)
    if getattr(shard, "norm", None) is not None:
        shard.norm = HtpRMSNorm(shard.norm)
    return convert_linear_to_conv2d(shard) if linear_as_conv else shard
