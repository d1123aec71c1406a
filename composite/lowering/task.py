"""One shard's work as a task that runs anywhere: in the export's process, a forked local worker,
or a Ray worker. A task is given a ShardWork (work.py: the shard's plan, its placement, where its
weights come from, and for a QNN shard the calibration run) and the float model's streams it
needs, and returns what the export writes (the .pte bytes and what the manifest says of them). Its
weights are read inside the task, one shard's worth, and let go when it ends.

Two kinds:
- lower_task: the shard lowered by its backend (lowering.lower_shard), and checked against what the
  manifest will say of it.
- float_task: run the float shard over the calibration calls; its outputs are the next shard's
  input (what a QNN shard further down is calibrated with).

Every task computes on one thread: where a task runs must not change its bytes (a matmul split over
threads can round differently), and the parallelism is across tasks.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from composite import manifest as manifest_schema
from composite import manifest_files, manifest_write
from composite.lowering import lower_shard
from composite.lowering.calibration import replay_wide
from composite.lowering.program import LoweredProgram
from composite.lowering.upstream_patches import provenance_shared
from composite.lowering.work import ShardWork, load_shard
from composite.runtime.threads import one_thread
from composite.units import MB


@dataclass
class ShardTaskResult:
    index: int
    shard: (
        LoweredProgram  # .buffer: the .pte bytes, .data its .ptd's (empty when the task wrote them beside work.output)
    )
    io: dict  # the manifest's description of its methods' inputs and outputs (checked against the program)
    stages: dict[str, float]  # where the task's time went: read, lower, serialize, calibrate, measure
    where: str  # host:pid of the process that ran it
    facts: dict = field(default_factory=dict)  # more for its manifest entry (BackendLowering.facts)


def here() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def float_task(work: ShardWork, stream: list | None = None) -> list:
    """The float shard's main output for each calibration call: the next shard's input. stream:
    the shard's own input per call (the previous float task's result; None: the calls' tokens)."""
    with one_thread():
        module = load_shard(dataclasses.replace(work, embedding_quantize=None))  # the float model's table
        return replay_wide(module, work.calls, stream, work.methods, work.max_seq_len)


def lower_task(work: ShardWork, stream: list | None = None, next_stream: list | None = None) -> ShardTaskResult:
    """The shard lowered. A QNN shard is calibrated on `stream` (its input per calibration call,
    None: the calls' tokens), its hidden output given the range of `next_stream` (the float
    shard's own output per call)."""
    work = dataclasses.replace(work, stream=stream, next_stream=next_stream)
    with one_thread(), provenance_shared():
        stages: dict[str, float] = {}
        lowered = lower_shard(work, stages)
        described = describe_io(work.io(), lowered.encodings)
        from executorch.runtime import Runtime

        manifest_files.check_against_program(
            Runtime.get().load_program(lowered.shard.buffer), {"index": work.spec.index, "io": described}
        )
        if work.output is not None:  # written here: the bytes need not travel back
            write_files(lowered.shard, Path(work.output))
            lowered.shard.buffer = lowered.shard.data = b""
        return ShardTaskResult(work.spec.index, lowered.shard, described, stages, here(), lowered.facts)


def write_files(shard: LoweredProgram, pte: Path) -> None:
    """The shard's .pte at `pte` and, if it keeps weights outside it, its .ptd beside it (what
    the task did not write itself: empty bytes are not written)."""
    if shard.buffer:
        pte.write_bytes(shard.buffer)
    if shard.data:
        pte.with_suffix(".ptd").write_bytes(shard.data)


def merge_data_files(folder: Path, shards: list[dict]) -> None:
    """The shards' own data files (shard_NN.ptd) merged into the one file they share, equal bytes
    once (lowering/shared_table.py: the tied table); their entries then name it."""
    readers = [shard for shard in shards if "data" in shard]
    if not readers:
        return
    from composite.lowering import data_files  # not on import: ExecuTorch's serializer

    merged, separate = data_files.merge(folder, [shard["data"]["file"] for shard in readers])
    shared = manifest_write.file_entry(folder / data_files.DATA_FILE)
    for shard in readers:
        shard["data"] = shared
    readers[0]["notes"] = [
        *readers[0]["notes"],
        f"{shared['file']}: {merged / MB:.2f} MB shared by shards {', '.join(str(s['index']) for s in readers)} "
        f"({separate / MB:.2f} MB as separate files)",
    ]


def describe_io(io: dict, encodings: dict) -> dict:
    """method -> {"inputs", "outputs"} as the manifest lists them; encodings: method -> ("in" |
    "out", name) -> Encoding of the tensors a QNN shard takes or gives in its own dtype."""
    described = {}
    for method, (inputs, outputs) in io.items():
        native = {
            key: (manifest_schema.dtype_name(e.dtype), e.quant_entry()) for key, e in encodings.get(method, {}).items()
        }
        described[method] = {
            "inputs": manifest_write.tensor_entries(inputs, {n: q for (side, n), q in native.items() if side == "in"}),
            "outputs": manifest_write.tensor_entries(
                outputs, {n: q for (side, n), q in native.items() if side == "out"}
            ),
        }
    return described
