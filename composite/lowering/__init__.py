"""Lower one shard to one .pte with the backend its placement names.

LOWER maps each backend to its `lower(work, stages) -> Lowered`: it reads the shard's weights as
`work` (a ShardWork, work.py) says, lowers them, and gives back the lowered program (its .pte
bytes, delegates, CPU operators, notes), the encodings of the I/O it takes or gives in another
dtype than float32, and what more the manifest entry says of it; `stages` gets where its time
went. What ends up delegated is read back from the lowered program, never assumed from the
placement. task.py runs a shard's lowering as a job.
"""

from __future__ import annotations

from composite.lowering import portable, qnn, xnnpack

LOWER = {"xnnpack": xnnpack.lower, "portable": portable.lower, "qnn": qnn.lower}
