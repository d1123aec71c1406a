"""The HTP-friendly form of a shard, used for QNN shards only.

Same weights, same function, different graph:
- attention in single heads: one projection per head and one score matmul per head, so HTP sees
  2-D matmuls and no 4-D transposes of [B, heads, T, hd] tensors (ExecuTorch's own MHA→SHA pass
  does not apply to this model and crashes the x86 simulator when it does);
- RMSNorm as one `rms_norm` op, which QNN runs as a single RmsNorm node: a quantized graph then
  never materialises x², whose range is what breaks 16-bit fixed point;
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

from composite.model.llama import Attention, RMSNorm, apply_rope


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
        head = nn.Linear(linear.in_features, rows, bias=False)
        head.weight = nn.Parameter(linear.weight.detach()[i * rows : (i + 1) * rows].clone())
        heads.append(head)
    return heads


class HtpAttention(nn.Module):
    """Attention.forward with one projection and one score matmul per head (same I/O contract)."""

    def __init__(self, attention: Attention):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.wq = _split_rows(attention.wq, self.n_heads)
        self.wk = _split_rows(attention.wk, self.n_kv_heads)
        self.wv = _split_rows(attention.wv, self.n_kv_heads)
        self.wo = attention.wo

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        s = k_cache.shape[-1]
        rep = self.n_heads // self.n_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        mask = mask.view(t, s + t)
        k_news, v_news, outputs = [], [], []
        for g in range(self.n_kv_heads):
            k = apply_rope(self.wk[g](x), cos, sin)  # [b, t, hd]
            v = self.wv[g](x)
            k_t = k.transpose(1, 2)  # [b, hd, t]
            k_news.append(k_t)
            v_news.append(v)
            for r in range(rep):
                q = apply_rope(self.wq[g * rep + r](x), cos, sin) * scale
                scores = torch.cat((q @ k_cache[:, g], q @ k_t), dim=-1) + mask
                probs = torch.softmax(scores, dim=-1)
                outputs.append(probs[..., :s] @ v_cache[:, g] + probs[..., s:] @ v)
        out = self.wo(torch.cat(outputs, dim=-1))
        return out, torch.stack(k_news, dim=1), torch.stack(v_news, dim=1)


def htp_form(shard: nn.Module) -> nn.Module:
    """A copy of `shard` in the HTP-friendly form; the caller's module is left as it was."""
    from executorch.backends.qualcomm.utils.utils import convert_linear_to_conv2d

    shard = copy.deepcopy(shard)
    for layer in shard.layers.values():
        layer.attention = HtpAttention(layer.attention)
        layer.attention_norm = HtpRMSNorm(layer.attention_norm)
        layer.ffn_norm = HtpRMSNorm(layer.ffn_norm)
    if getattr(shard, "norm", None) is not None:
        shard.norm = HtpRMSNorm(shard.norm)
    return convert_linear_to_conv2d(shard)
