"""No delegate: every operator runs on ExecuTorch's portable CPU kernels."""

from __future__ import annotations

from executorch.exir import to_edge_transform_and_lower

from composite.lowering.program import export_methods


def lower(module, example_inputs: dict, names: dict, options: dict):
    """-> (EdgeProgramManager, notes, encodings of non-float32 I/O: none, every tensor is float32)."""
    return to_edge_transform_and_lower(export_methods(module, example_inputs)), [], {}
