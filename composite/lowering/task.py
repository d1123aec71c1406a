"""One shard's work as a task that runs anywhere: in the export's process, a forked local worker,
or a Ray worker. A task carries what it needs (the shard's plan, its placement, where its weights
come from, and for a QNN shard the calibration run and the float model's input to the shard) and
returns what the export writes (the .pte bytes and what the manifest says of them). Its weights
are read inside the task, one shard's worth, and let go when it ends.

Two kinds:
- lower_task: read the shard's weights, rotate them as the export says, lower (XNNPACK, portable,
  or QNN after calibration), and measure a QNN shard against its float self.
- float_task: run the float shard over the calibration calls; its outputs are the next shard's
  input (what a QNN shard further down is calibrated with).

Every task computes on one thread: where a task runs must not change its bytes (a matmul split over
threads can round differently), and the parallelism is across tasks.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from composite import manifest as manifest_schema
from composite.config import Placement
from composite.lowering import embedding
from composite.lowering.calibration import Call, replay
from composite.lowering.program import LoweredShard
from composite.manifest import DECODE, PREFILL
from composite.model.llama import ModelArgs
from composite.model.loaded import build_model, part_names
from composite.model.rotation import rotate
from composite.model.weights import WeightSource
from composite.split.plan import ShardSpec
from composite.split.shard import ShardModule, shard_io


@dataclass
class ShardWork:
    spec: ShardSpec
    placement: Placement
    args: ModelArgs
    weights: WeightSource  # holds at least the tensors of this shard's part
    rotation: str  # the export's rotate setting, resolved (model/rotation.py)
    max_seq_len: int
    prefill_len: int
    embedding_quantize: tuple[int, int] | None = None  # (bits, group) of shard 0's table
    head_shard: int = 0  # where a tied head keeps its copy of the table (the embedding's notes say)
    calls: list[Call] | None = None  # QNN and float tasks: the calibration run
    stream: list | None = None  # a QNN shard's input per call, from the float model (None: tokens)

    @property
    def methods(self) -> dict[str, int]:
        return {DECODE: 1, PREFILL: self.prefill_len}

    @property
    def label(self) -> str:
        return f"shard {self.spec.index}"


@dataclass
class ShardLowered:
    index: int
    shard: LoweredShard  # .buffer: the .pte bytes
    io: dict  # the manifest's description of its methods' inputs and outputs (checked against the program)
    stages: dict[str, float]  # where the task's time went: read, lower, serialize, calibrate, measure
    where: str  # host:pid of the process that ran it
    qnn: dict = field(default_factory=dict)  # QNN: spill_fill_bytes (its own need), sqnr_db, sqnr_worst_token_db


@contextmanager
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def here() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def float_shard(work: ShardWork) -> ShardModule:
    """The shard's float module, its weights read now and rotated as the export says."""
    spec = work.spec
    tensors = work.weights.read(part_names(work.args, spec.has_embedding, spec.layers, spec.has_head))
    model = build_model(work.args, tensors, spec.has_embedding)
    del tensors
    rotate(model, work.rotation)
    return ShardModule(model, spec).eval()


def float_task(work: ShardWork, stream: list | None = None) -> list:
    """The float shard's main output for each calibration call: the next shard's input. stream:
    the shard's own input per call (the previous float task's result; None: the calls' tokens)."""
    with one_thread():
        module = float_shard(work)
        return replay(module, work.calls, stream, work.methods, work.max_seq_len)


def lower_task(work: ShardWork, stream: list | None = None) -> ShardLowered:
    """The shard lowered (a QNN shard calibrated on `stream`, its input per calibration call)."""
    if stream is not None:
        work = dataclasses.replace(work, stream=stream)
    with one_thread():
        stages = {}
        started = time.perf_counter()
        module = float_shard(work)
        stages["read"] = time.perf_counter() - started
        io = {m: shard_io(work.args, work.spec, n, work.max_seq_len) for m, n in work.methods.items()}
        names = {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in io.items()}
        examples = {m: tuple(t.example() for t in inputs) for m, (inputs, _) in io.items()}
        if work.placement.backend == "qnn":
            lowered, encodings, qnn = _lower_qnn(work, module, examples, names, stages)
        else:
            (lowered, encodings), qnn = _lower_cpu(work, module, examples, names, stages), {}
        described = describe_io(io, encodings)
        from executorch.runtime import Runtime

        manifest_schema.check_against_program(
            Runtime.get().load_program(lowered.buffer), {"index": work.spec.index, "io": described}
        )
        return ShardLowered(work.spec.index, lowered, described, stages, here(), qnn)


def describe_io(io: dict, encodings: dict) -> dict:
    """method -> {"inputs", "outputs"} as the manifest lists them; encodings: method -> ("in" |
    "out", name) -> Encoding of the tensors a QNN shard takes or gives in its own dtype."""
    described = {}
    for method, (inputs, outputs) in io.items():
        native = {
            key: (manifest_schema.dtype_name(e.dtype), e.quant_entry()) for key, e in encodings.get(method, {}).items()
        }
        described[method] = {
            "inputs": manifest_schema.tensor_entries(inputs, {n: q for (side, n), q in native.items() if side == "in"}),
            "outputs": manifest_schema.tensor_entries(
                outputs, {n: q for (side, n), q in native.items() if side == "out"}
            ),
        }
    return described


def _lower_cpu(work: ShardWork, module: ShardModule, examples, names, stages) -> tuple[LoweredShard, dict]:
    from composite.lowering import finish, lower_shard

    notes = []
    started = time.perf_counter()
    if work.spec.has_embedding and work.embedding_quantize is not None:
        bits, group = work.embedding_quantize
        notes = embedding.quantize(module, bits, group, work.head_shard, work.args.tie_embeddings)
    edge, lowering_notes, encodings = lower_shard(module, examples, names, work.placement, consume=True)
    del module
    stages["lower"] = time.perf_counter() - started
    started = time.perf_counter()
    shard = finish(edge, lowering_notes + notes)
    stages["serialize"] = time.perf_counter() - started
    return shard, encodings


def _lower_qnn(work: ShardWork, module: ShardModule, examples, names, stages) -> tuple[LoweredShard, dict, dict]:
    from composite.lowering.qnn import lower_qnn_shard

    lowered = lower_qnn_shard(
        module, examples, names, work.placement.options, work.calls, work.stream, work.max_seq_len
    )
    stages.update(lowered.stages)
    qnn = {
        "spill_fill_bytes": lowered.spill_fill_bytes,
        "sqnr_db": lowered.sqnr_db,
        "sqnr_worst_token_db": lowered.sqnr_worst_token_db,
    }
    return lowered.shard, lowered.io_encodings, qnn
