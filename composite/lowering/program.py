"""From an exported shard to the bytes of its .pte, and what the lowered program holds: the steps
every backend shares (composite.lowering dispatches to the backends)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class LoweredProgram:
    buffer: bytes
    delegates: dict[str, dict[str, int]]  # method -> backend id -> number of delegate calls
    cpu_ops: dict[str, list[str]]  # method -> operators run by ExecuTorch's CPU kernels
    notes: list[str]  # e.g. linears left unquantized
    data: bytes = b""  # the .ptd of the weights it keeps outside the .pte (lowering/shared_table.py)

    @property
    def backends(self) -> list[str]:
        return sorted({backend for per_method in self.delegates.values() for backend in per_method})


@dataclass
class BackendLowering:
    """What a backend's lower(work, stages) gives back."""

    shard: LoweredProgram
    encodings: dict  # method -> ("in" | "out", name) -> Encoding of the I/O that is not float32
    facts: dict = field(default_factory=dict)  # more for the manifest entry (QNN: spill-fill, SQNR, ...)


@contextmanager
def timed(stages: dict[str, float], name: str) -> Iterator[None]:
    """stages[name] = the seconds the block took."""
    started = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = time.perf_counter() - started


def inspect_program(manager) -> tuple[dict, dict]:
    program = manager.executorch_program
    delegates, cpu_ops = {}, {}
    for plan in program.execution_plan:
        counts: dict[str, int] = {}
        ops: set[str] = set()
        for chain in plan.chains:
            for instruction in chain.instructions:
                args = instruction.instr_args
                if hasattr(args, "delegate_index"):
                    backend = plan.delegates[args.delegate_index].id
                    counts[backend] = counts.get(backend, 0) + 1
                elif hasattr(args, "op_index"):
                    op = plan.operators[args.op_index]
                    ops.add(f"{op.name}.{op.overload}" if op.overload else op.name)
        delegates[plan.name] = counts
        cpu_ops[plan.name] = sorted(ops)
    return delegates, cpu_ops


def executorch_config(planning: dict | None = None, external=None):
    """Graph inputs are not memory-planned: runners bind their own buffers (the KV cache above all)
    as method inputs, so nothing is copied into the program's arena on each call. planning: method
    -> a memory-planning pass of its own (quantized I/O), which must not plan inputs either.
    external: node -> data-file tag or None, for constants kept outside the .pte."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=planning or MemoryPlanningPass(alloc_graph_input=False),
        external_constants=external or False,
    )


def export_methods(module: torch.nn.Module, example_inputs: dict[str, tuple]) -> dict:
    with torch.no_grad():
        return {name: torch.export.export(module, inputs, strict=False) for name, inputs in example_inputs.items()}


def finish(edge, notes: list[str], planning: dict | None = None, external=None, data_file=None) -> LoweredProgram:
    """external: ExecutorchBackendConfig's external_constants (which constants leave the .pte).
    The weights the program keeps outside its .pte (those, or a delegate's named data tagged for a
    data file: lowering/shared_table.py) are moved to `data_file` (a Path) when given, else come
    back as .data."""
    manager = edge.to_executorch(executorch_config(planning, external))
    delegates, cpu_ops = inspect_program(manager)
    return LoweredProgram(manager.buffer, delegates, cpu_ops, notes, program_data(manager, data_file))


def program_data(manager, data_file: Path | None) -> bytes:
    """The program's one data file: moved to data_file (written once, beside it, then renamed),
    or its bytes; b"" when the program keeps every weight in its .pte."""
    with tempfile.TemporaryDirectory(dir=data_file.parent if data_file is not None else None) as folder:
        manager.write_tensor_data_to_file(folder)
        files = sorted(Path(folder).glob("*.ptd"))
        if len(files) > 1:
            raise RuntimeError(f"a shard's program keeps its weights in {len(files)} data files; the export writes one")
        if not files:
            return b""
        if data_file is None:
            return files[0].read_bytes()
        files[0].replace(data_file)
        return b""
