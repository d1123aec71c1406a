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
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from composite import manifest as manifest_schema
from composite.config import Placement
from composite.lowering import embedding
from composite.lowering.calibration import Call, replay_wide
from composite.lowering.program import LoweredShard, provenance_shared
from composite.manifest import DECODE, PREFILL
from composite.model.llama import ModelArgs, Transformer, rope_inv_freq
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
    next_stream: list | None = None  # ...and its float output per call (the next shard's input)
    output: str | None = None  # where to write the .pte, where the task shares the export's disk

    @property
    def methods(self) -> dict[str, int]:
        return {DECODE: 1, PREFILL: self.prefill_len}

    @property
    def label(self) -> str:
        return f"shard {self.spec.index}"


@dataclass
class ShardLowered:
    index: int
    shard: LoweredShard  # .buffer: the .pte bytes (empty when the task wrote them to work.output)
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


def units(spec: ShardSpec) -> list[str | int]:
    """The parts a shard is read in: "embedding", each layer's index, "head"."""
    return (["embedding"] if spec.has_embedding else []) + list(spec.layers) + (["head"] if spec.has_head else [])


def load_shard(work: ShardWork, each_unit: Callable[[Transformer, str | int], None] | None = None) -> ShardModule:
    """The shard's module, read one unit (embedding, layer, head) at a time: each is read, rotated
    as the export says and handed to each_unit(model, unit) (an XNNPACK shard quantizes it there)
    before the next is read, so float32 weights of one unit at most are alive at once besides
    what each_unit keeps. A unit rotated alone is the same unit of the whole model rotated."""
    args, spec = work.args, work.spec
    with torch.device("meta"):
        model = Transformer(args)
    model.inv_freq = rope_inv_freq(args)
    for unit in units(spec):
        embedding, head = unit == "embedding", unit == "head"
        layers = range(unit, unit + 1) if isinstance(unit, int) else range(0)
        tied_here = head and args.tie_embeddings and spec.has_embedding and work.rotation == "none"
        if tied_here:  # one table for both, as Transformer ties them (a rotated head gets its own)
            part = build_model(args, work.weights.read(part_names(args, False, layers, False) + ["norm.weight"]), False)
            part.output.weight = model.tok_embeddings.weight
        else:
            part = build_model(args, work.weights.read(part_names(args, embedding, layers, head)), embedding)
        rotate(part, work.rotation)
        if embedding:
            model.tok_embeddings = part.tok_embeddings
        elif head:
            model.norm, model.output = part.norm, part.output
        else:
            model.layers[unit] = part.layers[unit]
        del part
        if each_unit is not None:
            each_unit(model, unit)
    return ShardModule(model, spec).eval()


def float_task(work: ShardWork, stream: list | None = None) -> list:
    """The float shard's main output for each calibration call: the next shard's input. stream:
    the shard's own input per call (the previous float task's result; None: the calls' tokens)."""
    with one_thread():
        module = load_shard(work)
        return replay_wide(module, work.calls, stream, work.methods, work.max_seq_len)


def lower_task(work: ShardWork, stream: list | None = None, next_stream: list | None = None) -> ShardLowered:
    """The shard lowered. A QNN shard is calibrated on `stream` (its input per calibration call,
    None: the calls' tokens), its hidden output given the range of `next_stream` (the float
    shard's own output per call)."""
    work = dataclasses.replace(work, stream=stream, next_stream=next_stream)
    with one_thread(), provenance_shared():
        stages = {}
        io = {m: shard_io(work.args, work.spec, n, work.max_seq_len) for m, n in work.methods.items()}
        names = {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in io.items()}
        examples = {m: tuple(t.example() for t in inputs) for m, (inputs, _) in io.items()}
        if work.placement.backend == "qnn":
            lowered, encodings, qnn = _lower_qnn(work, examples, names, stages)
        else:
            (lowered, encodings), qnn = _lower_cpu(work, examples, names, stages), {}
        described = describe_io(io, encodings)
        from executorch.runtime import Runtime

        manifest_schema.check_against_program(
            Runtime.get().load_program(lowered.buffer), {"index": work.spec.index, "io": described}
        )
        if work.output is not None:  # written here: the bytes need not travel back
            Path(work.output).write_bytes(lowered.buffer)
            lowered.buffer = b""
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


def _lower_cpu(work: ShardWork, examples, names, stages) -> tuple[LoweredShard, dict]:
    """An XNNPACK or portable shard. A quantized XNNPACK shard quantizes each unit as it is read
    (its float weights go before the next unit's come), and the embedding table as well."""
    from composite.lowering import finish, lower_shard
    from composite.lowering.xnnpack import fp32_note, quantize_linears

    options = work.placement.options
    quantized = work.placement.backend == "xnnpack" and options.get("quantize", "none") != "none"
    notes, skipped = [], []

    def each_unit(model, unit):
        if unit == "embedding" and work.embedding_quantize is not None:
            bits, group = work.embedding_quantize
            notes.extend(embedding.quantize(model, bits, group, work.head_shard, work.args.tie_embeddings))
        elif quantized and unit != "embedding":
            quantize_linears(
                model, options, in_place=True, only="output" if unit == "head" else f"layers.{unit}", skipped=skipped
            )

    started = time.perf_counter()
    module = load_shard(work, each_unit)
    stages["read+quantize"] = time.perf_counter() - started
    started = time.perf_counter()
    edge, lowering_notes, encodings = lower_shard(module, examples, names, work.placement, prequantized=quantized)
    del module
    stages["lower"] = time.perf_counter() - started
    started = time.perf_counter()
    shard = finish(edge, fp32_note(skipped, options) + lowering_notes + notes)
    stages["serialize"] = time.perf_counter() - started
    return shard, encodings


def _lower_qnn(work: ShardWork, examples, names, stages) -> tuple[LoweredShard, dict, dict]:
    from composite.lowering.qnn import lower_qnn_shard

    lowered = lower_qnn_shard(
        lambda: load_shard(work),
        examples,
        names,
        work.placement.options,
        work.calls,
        work.stream,
        work.max_seq_len,
        next_stream=work.next_stream,
        # beside the .pte it writes (the export's disk), else where temporary files go
        weights_to=str(Path(work.output).parent) if work.output else tempfile.gettempdir(),
    )
    stages.update(lowered.stages)
    qnn = {
        "spill_fill_bytes": lowered.spill_fill_bytes,
        "htp_context_bytes": lowered.context_bytes,
        "sqnr_db": lowered.sqnr_db,
        "sqnr_worst_token_db": lowered.sqnr_worst_token_db,
    }
    return lowered.shard, lowered.io_encodings, qnn
