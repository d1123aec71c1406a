"""No delegate: every operator runs on ExecuTorch's portable CPU kernels."""

from __future__ import annotations

from composite.lowering import shared_table
from composite.lowering.program import BackendLowering, export_methods, finish, timed
from composite.lowering.work import ShardWork, load_shard


def lower_portable_shard(work: ShardWork, stages: dict[str, float]) -> BackendLowering:
    """The shard read (its embedding table quantized as work says) and lowered; every tensor it
    takes and gives is float32."""
    from executorch.exir import to_edge_transform_and_lower

    notes: list[str] = []
    with timed(stages, "read+quantize"):
        module = load_shard(work, notes=notes)
    with timed(stages, "lower"):
        edge = to_edge_transform_and_lower(export_methods(module, work.examples()))
        del module
    with timed(stages, "serialize"):
        lookup = shared_table.tag_lookup if work.shared_table else None
        shard = finish(edge, notes, external=lookup, data_file=work.data_file)
    return BackendLowering(shard, {})
