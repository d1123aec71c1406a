"""XNNPACK: fp32, or 8-bit dynamic activations with 4-bit grouped weights (8da4w, torchao).

Decode attention runs in our composite::attention kernel, which reads only the valid cache slots
(`attention: kernel`, the default; composite/ops/attention.py), with the projections around it in
XNNPACK; or it stays in the graph as masked matmuls over every slot (`attention: graph`). Prefill
keeps the graph's batched matmuls either way."""

from __future__ import annotations

import copy
import math
import sys

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from torch import nn

from composite.errors import UserError
from composite.lowering.program import export_methods
from composite.model.llama import Attention, RMSNorm


class XnnpackRMSNorm(nn.Module):
    """RMSNorm with mean(x^2) as a matmul by a constant 1/dim column. XNNPACK has no mean over the
    last dimension of a 3-D tensor; left to ExecuTorch's CPU kernel, every norm would cut a layer
    into separate delegate calls."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight
        dim = norm.weight.shape[0]
        self.register_buffer("mean_column", torch.full((dim, 1), 1.0 / dim), persistent=False)

    def forward(self, x):
        return x * torch.rsqrt((x * x) @ self.mean_column + self.eps) * self.weight


class KernelAttention(nn.Module):
    """Attention.forward with scores, softmax and values in composite::attention (same I/O)."""

    def __init__(self, attention: Attention):
        super().__init__()
        import composite.ops.attention  # noqa: F401  (defines torch.ops.composite.attention)

        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        self._project = attention._project

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        kv, hd = self.n_kv_heads, self.head_dim
        q, k, v = self._project(x, cos, sin)
        q = q.reshape(kv, self.n_heads // kv * t, hd) * (1.0 / math.sqrt(hd))
        k_new = k.reshape(kv, t, hd).transpose(1, 2)  # [kv, hd, t]
        v_new = v.reshape(kv, t, hd)
        out = torch.ops.composite.attention(q, k_cache, v_cache, k_new, v_new, mask)
        out = out.view(b, self.n_heads, t, hd).transpose(1, 2).reshape(b, t, self.n_heads * hd)
        return self.wo(out), k_new, v_new


def xnnpack_form(module: nn.Module, attention: str = "graph") -> nn.Module:
    """A copy of `module` with XNNPACK-friendly norms and, with attention "kernel", our attention
    operator; parameters are shared, not copied."""
    module = copy.deepcopy(module, memo={id(p): p for p in module.parameters()})
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, XnnpackRMSNorm(child))
            elif isinstance(child, Attention) and attention == "kernel":
                setattr(parent, name, KernelAttention(child))
    return module


def quantize_8da4w(module: torch.nn.Module, group_size: int) -> tuple[torch.nn.Module, list[str]]:
    """A quantized copy (the caller's module keeps its float weights) and notes on what was skipped."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    module = copy.deepcopy(module)
    skipped = []

    def takes(linear: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(linear, torch.nn.Linear):
            return False
        if group_size and linear.in_features % group_size:
            skipped.append(fqn)
            return False
        return True

    quantize_(
        module,
        Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4,
            weight_granularity=PerAxis(0) if group_size == 0 else PerGroup(group_size),
        ),
        filter_fn=takes,
    )
    notes = (
        [
            f"{len(skipped)} linears left in fp32 (in_features not a multiple of group size {group_size}): {', '.join(skipped)}"
        ]
        if skipped
        else []
    )
    return module, notes


def lower(module, example_inputs: dict, options: dict):
    """With attention "kernel", the one-token method (decode) calls composite::attention; wider
    methods (prefill) keep the graph's batched matmuls, which XNNPACK runs faster over many rows.
    Both forms hold the same weights, which the program stores once."""
    forms = {"graph": xnnpack_form(module, "graph")}
    if options.get("attention") == "kernel":
        forms["kernel"] = xnnpack_form(module, "kernel")
    notes = []
    if options.get("quantize") == "8da4w":
        for name in forms:
            forms[name], notes = quantize_8da4w(forms[name], options["group_size"])
    exported = {}
    for method, inputs in example_inputs.items():
        form = forms["kernel"] if "kernel" in forms and inputs[0].shape[1] == 1 else forms["graph"]
        exported.update(export_methods(form, {method: inputs}))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    return edge, notes


def check_group_sizes(args, placements: list) -> None:
    """8da4w groups must divide a linear's input width, or that linear stays fp32: say so before
    any lowering, and refuse a group size that would leave every linear unquantized."""
    widths = {"dim": args.dim, "hidden_dim": args.hidden_dim, "n_heads x head_dim": args.n_heads * args.head_dim}
    for group in sorted(
        {
            p.options["group_size"]
            for p in placements
            if p.backend == "xnnpack" and p.options["quantize"] == "8da4w" and p.options["group_size"]
        }
    ):
        misfits = {name: width for name, width in widths.items() if width % group}
        described = ", ".join(f"{name} {width}" for name, width in misfits.items())
        if len(misfits) == len(widths):
            raise UserError(
                f"--group-size {group} divides none of this model's linear input widths ({described}): "
                "nothing would be quantized; choose a divisor of them (e.g. 32), or 0 for per channel"
            )
        if misfits:
            print(f"warning: group size {group} does not divide {described}: those linears stay fp32", file=sys.stderr)
