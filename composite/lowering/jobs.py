"""The jobs of an export's lowering, in the order they should start.

Every shard that is not in the shard cache gets a lowering job. A QNN shard is calibrated with the
inputs the float model gives it, so the float shards before it run first, one job each, each over
the calibration run with the previous one's outputs (`float_task`): the chain is the export's
critical path, so its jobs come first, then the QNN lowerings that wait on it, then the rest.
QNN shards calibrated with different settings (calibration text, samples) get a chain each.
"""

from __future__ import annotations

import json

from composite.executor import Job, Result
from composite.lowering.calibration import calibration_calls, effective_options
from composite.lowering.task import ShardWork, float_task, lower_task
from composite.manifest import DECODE, PREFILL

MB = 1 << 20
# A worker process before it reads any weights: torch, ExecuTorch and the backends imported (a
# fork shares most of these pages with the export's process).
PROCESS_BYTES = 600 * MB


def shard_file(spec) -> str:
    return f"shard_{spec.index:02d}.pte"


def part_bytes(args, spec) -> int:
    """float32 bytes of the weights one shard reads (a tied head reads the embedding's table)."""
    from composite.split.plan import unit_bytes

    units = unit_bytes(args)  # [embedding, layer 0 .. layer L-1, head]
    return units[0] * spec.has_embedding + sum(units[1 + layer] for layer in spec.layers) + units[-1] * spec.has_head


def expected_bytes(work: ShardWork, lowering: bool) -> int:
    """A task's expected peak: its float weights, and for a lowering the copies lowering makes.
    Measured (the job's summed PSS above the process, per float32 byte of its weights): an XNNPACK
    8da4w shard of 6 layers of the Llama-3.2-1B shape, 1.4x. A quantized QNN shard holds more than
    its weights: calibration's observed graphs (the float weights), then, once they are gone, the
    methods' edge programs and the HTP compile's copies (its peak), 16a4w, weight-shared, context
    1024, 2026-12-05: a 3B-shaped shard of 2 layers 2.65 GB (2.54x above the process); the 3B
    hybrid's 7-layer shards 7.96-8.07 GB, where 2.6x expects 7.9. Since the weights wait on disk
    while QNN compiles (qnn.lean_preprocess) and node provenance is shared (program.provenance_shared)
    they peak at 6.96-7.09 GB (2026-12-06): the factor is kept, 12% high, as it only decides which
    jobs run together (one within 8 GB, two within 16, either way)."""
    weights = part_bytes(work.args, work.spec)
    if not lowering:
        factor = 1.2
    elif work.placement.quantized_qnn:
        factor = 2.6
    else:
        factor = 2.0
    return PROCESS_BYTES + int(weights * factor)


def lowering_jobs(loaded, specs, placements, config, tokenizer, bos_id, missing: list[int], write_to=None) -> list[Job]:
    """Jobs that lower the shards in `missing` (indices), with the float chains their QNN shards
    need. write_to: a folder the jobs write their .pte files into (where they share this disk),
    named as shard_file() names them; None: the files' bytes come back with the results."""
    methods = {DECODE: 1, PREFILL: config.prefill_len}
    # Local jobs run in processes forked from this one: ExecuTorch loaded here once, not in each of
    # them (2.6 s apiece). Not on import: the CLIs answer bad flags without it.
    import executorch.runtime  # noqa: F401

    def work(index: int, **extra) -> ShardWork:
        return ShardWork(
            specs[index],
            placements[index],
            loaded.args,
            loaded.weights,
            config.rotation(),
            config.max_seq_len,
            config.prefill_len,
            config.embedding_bits_and_group(),
            specs[-1].index,
            **extra,
        )

    def output(index: int) -> str | None:
        return None if write_to is None else str(write_to / shard_file(specs[index]))

    chains: dict[str, list[int]] = {}
    for index in missing:
        if placements[index].backend == "qnn":
            chains.setdefault(json.dumps(effective_options(placements, index), sort_keys=True), []).append(index)
    float_jobs, qnn_jobs, other_jobs = [], [], []
    for number, (key, indices) in enumerate(chains.items()):
        options = json.loads(key)
        calls = calibration_calls(options, tokenizer, loaded.args.vocab_size, methods, config.max_seq_len, bos_id)
        chain = f" (calibration {number + 1})" if len(chains) > 1 else ""

        def stream(index: int, chain: str = chain) -> tuple:
            """The float chain's output of shard `index`, as a job's argument (none before shard 0)."""
            return (Result(f"float shard {index}{chain}"),) if index >= 0 else (None,)

        # A quantized QNN shard's hidden output gets the range of the float chain's output of it.
        ranged = [i for i in indices if placements[i].quantized_qnn and not specs[i].has_head]
        for index in range(max([max(indices) - 1, *ranged]) + 1):
            shard_work = work(index, calls=calls)
            float_jobs.append(
                Job(
                    f"float shard {index}{chain}",
                    float_task,
                    (shard_work, *(stream(index - 1) if index else ())),
                    expected_bytes(shard_work, lowering=False),
                    f"the float pass of shard {index}",
                )
            )
        for index in indices:
            shard_work = work(index, calls=calls, output=output(index))
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
        if placements[index].backend != "qnn":
            shard_work = work(index, output=output(index))
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
