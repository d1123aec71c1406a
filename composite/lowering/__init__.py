"""Lower one shard to one .pte with the backend its placement names.

Every backend module exposes `lower(module, example_inputs, names, options) -> (EdgeProgramManager,
notes, encodings)`, where example_inputs maps method name -> tuple of example tensors, names maps
method name -> (input names, output names), and encodings gives the I/O that is not float32. What ends up delegated is read
back from the lowered program, never assumed from the placement.
"""

from __future__ import annotations

import torch

from composite.config import Placement
from composite.lowering.program import LoweredShard, export_methods, finish

__all__ = ["LoweredShard", "export_methods", "finish", "lower_shard"]


def lower_shard(
    module: torch.nn.Module,
    example_inputs: dict[str, tuple],
    names: dict,
    placement: Placement,
    prequantized: bool = False,
):
    """-> (EdgeProgramManager, notes, encodings) for an XNNPACK or portable shard (prequantized:
    its linears are quantized already, as the placement says). QNN shards, which are calibrated
    first, go through lowering.qnn.lower_qnn_shard."""
    if placement.backend == "xnnpack":
        from composite.lowering import xnnpack

        return xnnpack.lower(module, example_inputs, names, placement.options, prequantized)
    if placement.backend == "portable":
        from composite.lowering import portable

        return portable.lower(module, example_inputs, names, placement.options)
    raise ValueError(f"lower_shard does not lower {placement.backend} shards")
