"""Lower one shard to one .pte with the backend its placement names.

lower_shard(work, stages) calls the placement's backend: it reads the shard's weights as `work` (a
ShardWork, work.py) says, lowers them, and gives back a BackendLowering (program.py): the lowered
program (its .pte bytes, delegates, CPU operators, notes), the encodings of the I/O it takes or
gives in another dtype than float32, and what more the manifest entry says of it; `stages` gets
where its time went. What ends up delegated is read back from the lowered program, never assumed
from the placement. task.py runs a shard's lowering as a job.
"""

from __future__ import annotations

from composite.lowering.portable import lower_portable_shard
from composite.lowering.qnn.shard import lower_qnn_shard
from composite.lowering.xnnpack import lower_xnnpack_shard


def lower_shard(work, stages: dict[str, float]):
    """The shard of `work` lowered by its placement's backend -> BackendLowering."""
    backend = work.placement.backend
    if backend == "qnn":
        return lower_qnn_shard(work, stages)
    if backend == "xnnpack":
        return lower_xnnpack_shard(work, stages)
    if backend == "portable":
        return lower_portable_shard(work, stages)
    raise ValueError(f"no lowering for backend {backend!r}")  # config.py admits only the three
