"""One shard's work, described once: everything that decides its .pte bytes and manifest entry.

A ShardWork is what a lowering job (task.py) is given and what the shard cache keys (`key_parts`:
every field, or what decides it). It carries the shard's plan, its placement, where its weights
come from, and for a QNN shard the calibration run and the float model's input to the shard; it
reads its weights itself (`load_shard`), one unit at a time, and detaches itself for a process
without this machine's files (`for_remote`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from composite.config import Placement
from composite.lowering import embedding as embedding_table
from composite.lowering.calibration import Call
from composite.manifest import every_row_logits, method_widths
from composite.model.llama import ModelArgs, Transformer, rope_inv_freq
from composite.model.loaded import build_model, part_names
from composite.model.rotation import rotate
from composite.model.weights import WeightSource
from composite.split.plan import ShardSpec
from composite.split.shard import ShardModule, shard_io

# The fields the shard cache's key leaves out, and why they cannot change the shard's bytes.
NOT_IN_KEY = {"output": "where the .pte is written, not what it holds"}


@dataclass
class ShardWork:
    spec: ShardSpec
    placement: Placement
    args: ModelArgs
    weights: WeightSource  # holds at least the tensors of this shard's part
    rotation: str  # the export's rotate setting, resolved (model/rotation.py)
    max_seq_len: int
    prefill_len: int
    verify_len: int = 0  # width of the verify method (0: none)
    embedding_quantize: tuple[int, int] | None = None  # (bits, group) of the shard's table, if it has one
    head_shard: int = 0  # where a tied head keeps its copy of the table (a quantized table's notes say)
    calls: list[Call] | None = None  # QNN and float tasks: the calibration run
    stream: list | None = None  # a QNN shard's input per call, from the float model (None: tokens)
    next_stream: list | None = None  # ...and its float output per call (the next shard's input)
    output: str | None = None  # where to write the .pte, where the task shares the export's disk
    # The head's weight mapping when the tied table is stored once (lowering/shared_table.py): the
    # first shard's lookup is quantized as the head is, and both keep it in the shared data file.
    shared_table: str | None = None

    @property
    def methods(self) -> dict[str, int]:
        return method_widths(self.prefill_len, self.verify_len)

    @property
    def data_file(self) -> Path | None:
        """Where the task writes the weights its program keeps outside the .pte: beside .output."""
        return Path(self.output).with_suffix(".ptd") if self.output is not None else None

    @property
    def label(self) -> str:
        return f"shard {self.spec.index}"

    def io(self) -> dict:
        """method -> (input TensorSpecs, output TensorSpecs), in call order."""
        return {
            m: shard_io(self.args, self.spec, n, self.max_seq_len, every_row_logits(m)) for m, n in self.methods.items()
        }

    def names(self) -> dict[str, tuple[list[str], list[str]]]:
        """method -> (input names, output names), as the manifest lists them."""
        return {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in self.io().items()}

    def examples(self) -> dict[str, tuple]:
        """method -> example inputs, for tracing."""
        return {m: tuple(t.example() for t in inputs) for m, (inputs, _) in self.io().items()}

    def part(self) -> list[str]:
        """The checkpoint tensors the shard is made of."""
        spec = self.spec
        return part_names(self.args, spec.has_embedding, spec.layers, spec.has_head)

    def for_remote(self) -> ShardWork:
        """This work as a process without this machine's files takes it (a cluster's worker): its
        own part of the checkpoint in memory, nothing to write."""
        return dataclasses.replace(self, weights=self.weights.detached(self.part()), output=None)

    def key_parts(self, digests: Callable[[list[str]], dict[str, str]]) -> dict:
        """Every field (but NOT_IN_KEY's) as the shard cache's key holds it: the field itself, or
        what decides it. digests(names) -> name -> sha256 of those checkpoint tensors as stored.
        The float streams are the float model's outputs over `calls`: the model up to the shard
        (stream) and through it (next_stream) decides them."""
        spec, calibrated = self.spec, self.calls is not None

        def float_model(layer_end: int) -> dict | None:
            return digests(part_names(self.args, True, range(layer_end), False)) if calibrated else None

        return {
            "spec": [spec.layer_start, spec.layer_end, spec.has_embedding, spec.has_head],
            "placement": {"backend": self.placement.backend, "options": self.placement.options},
            "args": self.args.to_dict(),
            "weights": digests(self.part()),
            "rotation": self.rotation,
            "max_seq_len": self.max_seq_len,
            "prefill_len": self.prefill_len,
            "verify_len": self.verify_len,
            "embedding_quantize": self.embedding_quantize,
            "head_shard": self.head_shard,
            "shared_table": self.shared_table,
            "calls": calls_digest(self.calls) if calibrated else None,
            "stream": float_model(spec.layer_start),
            "next_stream": float_model(spec.layer_end),
        }


def calls_digest(calls: list[Call]) -> str:
    return hashlib.sha256(json.dumps([dataclasses.astuple(call) for call in calls]).encode()).hexdigest()


def units(spec: ShardSpec) -> list[str | int]:
    """The parts a shard is read in: "embedding", each layer's index, "head"."""
    return (["embedding"] if spec.has_embedding else []) + list(spec.layers) + (["head"] if spec.has_head else [])


def load_shard(
    work: ShardWork,
    each_unit: Callable[[Transformer, str | int], None] | None = None,
    notes: list[str] | None = None,
) -> ShardModule:
    """The shard's module, read one unit (embedding, layer, head) at a time: each is read, rotated
    as the export says, its table quantized where work.embedding_quantize says (what that did goes
    to `notes`), and handed to each_unit(model, unit) (an XNNPACK shard quantizes it there) before
    the next is read, so float32 weights of one unit at most are alive at once besides what
    each_unit keeps. A unit rotated alone is the same unit of the whole model rotated."""
    args, spec = work.args, work.spec
    with torch.device("meta"):
        model = Transformer(args)
    model.inv_freq = rope_inv_freq(args)
    float_table = None  # a tied head's weight: the table as read, before the lookup quantizes it
    for unit in units(spec):
        embedding, head = unit == "embedding", unit == "head"
        layers = range(unit, unit + 1) if isinstance(unit, int) else range(0)
        tied_here = head and args.tie_embeddings and spec.has_embedding and work.rotation == "none"
        if tied_here:  # one table for both, as Transformer ties them (a rotated head gets its own)
            part = build_model(args, work.weights.read(part_names(args, False, layers, False) + ["norm.weight"]), False)
            part.output.weight = float_table
        else:
            part = build_model(args, work.weights.read(part_names(args, embedding, layers, head)), embedding)
        rotate(part, work.rotation)
        if embedding:
            model.tok_embeddings = part.tok_embeddings
            float_table = part.tok_embeddings.weight if spec.has_head else None
        elif head:
            model.norm, model.output = part.norm, part.output
        else:
            model.layers[unit] = part.layers[unit]
        del part
        if embedding and work.embedding_quantize is not None:
            bits, group = work.embedding_quantize
            found = embedding_table.quantize(
                model, bits, group, work.head_shard, args.tie_embeddings, work.shared_table
            )
            if notes is not None:
                notes.extend(found)
        if each_unit is not None:
            each_unit(model, unit)
    return ShardModule(model, spec).eval()
