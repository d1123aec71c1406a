"""XNNPACK: fp32, or 8-bit dynamic activations with 4-bit grouped weights (8da4w, torchao)."""

from __future__ import annotations

import copy
import sys

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from torch import nn

from composite.errors import UserError
from composite.lowering.program import export_methods
from composite.model.llama import RMSNorm


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


def xnnpack_form(module: nn.Module) -> nn.Module:
    """A copy of `module` with XNNPACK-friendly norms; parameters are shared, not copied."""
    module = copy.deepcopy(module, memo={id(p): p for p in module.parameters()})
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, XnnpackRMSNorm(child))
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
    notes = []
    module = xnnpack_form(module)
    if options.get("quantize") == "8da4w":
        module, notes = quantize_8da4w(module, options["group_size"])
    edge = to_edge_transform_and_lower(export_methods(module, example_inputs), partitioner=[XnnpackPartitioner()])
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
