"""XNNPACK: fp32, or 8-bit dynamic activations with 4-bit grouped weights (8da4w, torchao)."""

from __future__ import annotations

import copy

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

from composite.lowering import export_methods


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
    notes = [f"{len(skipped)} linears left in fp32 (in_features not a multiple of group size {group_size}): {', '.join(skipped)}"] if skipped else []
    return module, notes


def lower(module, example_inputs: dict, options: dict):
    notes = []
    if options.get("quantize") == "8da4w":
        module, notes = quantize_8da4w(module, options["group_size"])
    edge = to_edge_transform_and_lower(export_methods(module, example_inputs), partitioner=[XnnpackPartitioner()])
    return edge, notes
