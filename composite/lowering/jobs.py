"""The jobs of an export's lowering, in the order they should start.

Every shard that is not in the shard cache gets a lowering job. A QNN shard is calibrated with the
inputs the float model gives it, so the float shards before it run first, one job each, each over
the calibration run with the previous one's outputs (`float_task`): the chain is the export's
critical path, so its jobs come first, then the QNN lowerings that wait on it, then the rest.
QNN shards calibrated with different settings (calibration text, samples) get a chain each.
"""

from __future__ import annotations

import dataclasses
import json

from composite.executor import Job, Result
from composite.lowering import shared_table
from composite.lowering.calibration import calibration_calls, effective_options, has_block_weights
from composite.lowering.qnn.weight_rounding import moment_bytes
from composite.lowering.task import float_task, lower_task
from composite.lowering.work import ShardWork
from composite.split.plan import unit_bytes
from composite.units import MIB

# A worker process before it reads any weights: torch, ExecuTorch and the backends imported (a
# fork shares most of these pages with the export's process).
PROCESS_BYTES = 600 * MIB


def shard_file(spec) -> str:
    return f"shard_{spec.index:02d}.pte"


def part_bytes(args, spec) -> int:
    """float32 bytes of the weights one shard reads (a tied head reads the embedding's table)."""
    units = unit_bytes(args)  # [embedding, layer 0 .. layer L-1, head]
    return units[0] * spec.has_embedding + sum(units[1 + layer] for layer in spec.layers) + units[-1] * spec.has_head


def expected_bytes(work: ShardWork, lowering: bool) -> int:
    """A task's expected peak: the worker process, and a factor of the shard's float32 weights for
    what the task holds beside it (its weights; a lowering's copies of them; a quantized QNN
    shard's observed graphs, edge programs and HTP compile). The factors are set at or above the
    peaks measured per kind of job (docs/scale.md, "The export's memory estimate"): the estimate
    decides which jobs run side by side within --max-memory and which shard is refused up front,
    so it errs high. A shard whose block-wise weights GPTQ rounds also holds its inputs' moments
    while it calibrates (counted on top, though they are freed before the compile's peak)."""
    weights = part_bytes(work.args, work.spec)
    if not lowering:
        return PROCESS_BYTES + int(weights * 1.2) + rotated_table_bytes(work)
    factor = 2.6 if work.placement.quantized_qnn else 2.0
    moments = 0
    if work.placement.backend == "qnn" and has_block_weights(work.placement.options):
        moments = moment_bytes(work.args, len(work.spec.layers))
    return PROCESS_BYTES + int(weights * factor) + moments


def rotated_table_bytes(work: ShardWork) -> int:
    """A rotated embedding or head is written into a new float32 table while the one read is alive
    (model/rotation.py): one table more than a float pass's factor counts; a lowering's factor
    already covers it (docs/scale.md, "The export's memory estimate")."""
    rotated_ends = work.rotation != "none" and (work.spec.has_embedding or work.spec.has_head)
    return unit_bytes(work.args)[0] if rotated_ends else 0  # the embedding's float32 table


def shard_works(loaded, specs, placements, config, tokenizer, bos_id) -> list[ShardWork]:
    """One ShardWork per shard: everything that decides its bytes. A QNN shard's carries its
    calibration run (the calls of its calibration settings; QNN shards with the same settings share
    one run, and one float chain)."""
    methods = config.methods()
    calls_by_settings: dict[str, list] = {}
    works = []
    shared = shared_table.head_mapping(loaded.args, config, placements)
    for spec, placement in zip(specs, placements):
        calls = None
        if placement.backend == "qnn":
            settings = json.dumps(effective_options(placements, spec.index), sort_keys=True)
            if settings not in calls_by_settings:
                calls_by_settings[settings] = calibration_calls(
                    json.loads(settings), tokenizer, loaded.args.vocab_size, methods, config.max_seq_len, bos_id
                )
            calls = calls_by_settings[settings]
        works.append(
            ShardWork(
                spec=spec,
                placement=placement,
                args=loaded.args,
                weights=loaded.weights,
                rotation=config.rotation(),
                max_seq_len=config.max_seq_len,
                prefill_len=config.prefill_len,
                verify_len=config.verify_len,
                embedding_quantize=config.embedding_bits_and_group() if spec.has_embedding else None,
                head_shard=specs[-1].index,
                calls=calls,
                shared_table=shared if spec.has_embedding or spec.has_head else None,
            )
        )
    return works


def lowering_jobs(works: list[ShardWork], missing: list[int], write_to=None) -> list[Job]:
    """Jobs that lower the shards in `missing` (indices into `works`), with the float chains their
    QNN shards need. write_to: a folder the jobs write their .pte files into (where they share
    this disk), named as shard_file() names them; None: the files' bytes come back with the results."""
    # Local jobs run in processes forked from this one: ExecuTorch loaded here once, not in each of
    # them. Not on import: the CLIs answer bad flags without it.
    import executorch.runtime  # noqa: F401

    def output(index: int) -> str | None:
        return None if write_to is None else str(write_to / shard_file(works[index].spec))

    chains: dict[int, list[int]] = {}  # id of a calibration run -> the missing QNN shards it calibrates
    for index in missing:
        if works[index].placement.backend == "qnn":
            chains.setdefault(id(works[index].calls), []).append(index)
    float_jobs, qnn_jobs, other_jobs = [], [], []
    for number, indices in enumerate(chains.values()):
        calls = works[indices[0]].calls
        chain = f" (calibration {number + 1})" if len(chains) > 1 else ""

        def stream(index: int, chain: str = chain) -> tuple:
            """The float chain's output of shard `index`, as a job's argument (none before shard 0)."""
            return (Result(f"float shard {index}{chain}"),) if index >= 0 else (None,)

        # A quantized QNN shard's hidden output gets the range of the float chain's output of it.
        ranged = [i for i in indices if works[i].placement.quantized_qnn and not works[i].spec.has_head]
        for index in range(max([max(indices) - 1, *ranged]) + 1):
            float_work = dataclasses.replace(works[index], calls=calls)
            float_jobs.append(
                Job(
                    f"float shard {index}{chain}",
                    float_task,
                    (float_work, *(stream(index - 1) if index else ())),
                    expected_bytes(float_work, lowering=False),
                    f"the float pass of shard {index}",
                )
            )
        for index in indices:
            shard_work = dataclasses.replace(works[index], output=output(index))
            after = stream(index) if index in ranged else (None,)
            qnn_jobs.append(
                Job(
                    f"lower shard {index}",
                    lower_task,
                    (shard_work, *stream(index - 1), *after),
                    expected_bytes(shard_work, True),
                    f"shard {index}",
                )
            )
    for index in missing:
        if works[index].placement.backend != "qnn":
            shard_work = dataclasses.replace(works[index], output=output(index))
            other_jobs.append(
                Job(
                    f"lower shard {index}",
                    lower_task,
                    (shard_work,),
                    expected_bytes(shard_work, True),
                    f"shard {index}",
                )
            )
    return float_jobs + qnn_jobs + other_jobs
