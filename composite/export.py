"""python -m composite.export: cut a LLaMA into N shards and lower each to its own .pte.

parse (flags over the YAML, config.py) -> plan (checkpoint, shards, placements) -> lower (each
shard with its backend: lowering/; QNN shards also together: spill_fill.py) -> write (a staging folder
renamed into place when complete: staging.py; the manifest: manifest.py).
"""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    # Run as the CLI: keep library chatter (torchao logs while ExecuTorch imports it) out before
    # those libraries load. Importing this module elsewhere changes nothing.
    quiet.silence_library_noise()

import errno
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from composite import chat_template, config_flags, manifest_write, qnn_host, shard_cache, spill_fill, staging
from composite.config import ExportConfig, Placement, check_group_sizes
from composite.errors import Failure, UserError, exits_cleanly
from composite.executor import Done, JobFailed
from composite.executor.fork import ForkedCall
from composite.executor.local import LocalExecutor, default_workers
from composite.executor.ray_cluster import from_ray_flag
from composite.export_report import JobProgress, JobRuns, print_summary, write_summary
from composite.lowering import embedding, shared_table
from composite.lowering.jobs import lowering_jobs, shard_file, shard_works
from composite.lowering.task import ShardTaskResult, lower_task, merge_data_files, write_files
from composite.manifest_files import sha256_file
from composite.memory import PeakMemory, Stopwatch, gb, give_back_freed_memory, meminfo, memory_budget
from composite.model.checkpoint import load_checkpoint
from composite.model.llama import cache_shapes, rope_inv_freq
from composite.model.loaded import LoadedModel
from composite.shard_cache import ShardCache
from composite.split.htp_limits import check_placement, layer_capacity
from composite.split.plan import ShardSpec, auto_layer_counts, plan_shards
from composite.tokenizer import Tokenizer, generation_stop_ids, prompt_bos_id, tokenizer_for_model


def lower_all(
    loaded: LoadedModel,
    specs: list[ShardSpec],
    placements: list[Placement],
    config: ExportConfig,
    tokenizer: Tokenizer | None,
    folder: Path,
    bos: int | None = None,
    cache: ShardCache | None = None,
    executor=None,
    watch: Stopwatch | None = None,
) -> tuple[list[dict], dict | None, JobRuns]:
    """Every shard written into `folder`: taken from the cache, or lowered by the executor's jobs
    (lowering/jobs.py) and stored there as soon as it is done, so an export that stops early
    keeps what it finished. -> (manifest entries, the manifest's qnn summary, how its jobs ran). bos: the id the runners put before a text prompt, which calibration puts before
    its text too."""
    watch = watch or Stopwatch()
    works = shard_works(loaded, specs, placements, config, tokenizer, bos)
    if note := shared_table.unshared_table_note(loaded.args, config, placements):
        print(note, file=sys.stderr)
    with watch.stage("cache keys"):
        keys = shard_cache.export_keys(works) if cache else {}
    entries = shard_cache.hits(cache, keys, folder, {spec.index: shard_file(spec) for spec in specs})
    missing = [spec.index for spec in specs if spec.index not in entries]
    executor = executor or LocalExecutor(default_workers())
    write_to = folder if executor.shares_files else None
    jobs = lowering_jobs(works, missing, write_to)
    runs = JobRuns()
    progress = JobProgress([job for job in jobs if job.fn is lower_task])

    def done(finished: Done) -> None:
        job_facts = {"job": finished.job.name, "needs": list(finished.job.needs), "seconds": finished.seconds}
        job_facts |= {"where": finished.where, "peak_bytes": finished.peak_bytes}
        if finished.job.fn is not lower_task:  # a float pass of the calibration chain
            runs.float_passes.append({**job_facts, "stages": {"float pass": finished.seconds}})
            return
        progress.finished(finished.job)
        result: ShardTaskResult = finished.result
        spec, placement = specs[result.index], placements[result.index]
        path = folder / shard_file(spec)
        write_files(result.shard, path)  # from a job that does not share this disk
        entry = manifest_write.shard_entry(path, spec, placement, result.shard, result.io, finished.seconds)
        entries[spec.index] = {**entry, **result.facts}
        shard_cache.store(cache, keys, entries[spec.index], folder)
        runs.shards[spec.index] = {**job_facts, "stages": result.stages}

    try:
        with watch.stage("lowering"):
            executor.run(jobs, done, progress.started)
    finally:
        progress.close()
    shards = [entries[i] for i in sorted(entries)]
    merge_data_files(folder, shards)
    if not any(p.backend == "qnn" for p in placements):
        return shards, None, runs
    with watch.stage("spill-fill"):
        summary = spill_fill.settle(folder, shards, [run["stages"] for run in runs.every()])
    return shards, summary, runs


def build_manifest(
    loaded: LoadedModel,
    tokenizer: Tokenizer | None,
    chat: dict | None,
    config: ExportConfig,
    shards: list[dict],
    qnn_summary: dict | None,
) -> dict:
    args = loaded.args
    tokenizer_entry = tokenizer and {
        "file": tokenizer.path.name,
        "type": tokenizer.kind,
        "sha256": sha256_file(tokenizer.path),
    }
    return manifest_write.document(
        export_id=uuid.uuid4().hex,
        model=args.to_dict(),
        source={"kind": loaded.kind, "path": loaded.path, "rotation": config.rotation()},
        max_seq_len=config.max_seq_len,
        methods=config.methods(),
        cache_shapes=cache_shapes(args, config.max_seq_len),
        rope_inv_freq=rope_inv_freq(args).tolist(),
        tokenizer=tokenizer_entry,
        bos_id=prompt_bos_id(loaded, tokenizer),
        eos_ids=generation_stop_ids(loaded, tokenizer, chat),
        chat=chat,
        shards=shards,
        qnn=qnn_summary,
        versions=manifest_write.versions(),
    )


def run_export(
    config: ExportConfig, cache: ShardCache | None = None, executor=None, summary: Path | None = None
) -> Path:
    """Export `config`; shards are taken from and stored in `cache` unless it is None. executor:
    where the lowering jobs run (default: forked processes on this machine, one per core).
    summary: where to write the summary as JSON."""
    started = time.perf_counter()
    watch = Stopwatch()
    placements = config.placements()
    if any(p.backend == "qnn" for p in placements):
        qnn_host.activate()  # before any slow work: may re-execute this process once
    output = Path(config.output)
    staging.check_output(output)
    if config.tokenizer:
        Tokenizer(Path(config.tokenizer))  # refuse a bad tokenizer before the weights load
    if config.chat_template:
        chat_template.read_template_file(Path(config.chat_template))
    give_back_freed_memory()
    with PeakMemory() as memory:
        folder = staging.make_staging(output)
        try:
            with watch.stage("open checkpoint"):
                loaded = load_checkpoint(config.checkpoint, config.params)
            specs = plan(loaded.args, config, placements)
            htp = check_placement(loaded.args, specs, placements, config.max_seq_len, config.methods())
            check_group_sizes(loaded.args, placements)
            if config.embedding_bits_and_group() is not None:
                embedding.check(loaded.args.dim, *config.embedding_bits_and_group())
            tokenizer = tokenizer_for_model(config.tokenizer or loaded.tokenizer_path, loaded.args.vocab_size)
            first_bos = prompt_bos_id(loaded, tokenizer)
            chat = chat_template.chat_entry(
                tokenizer,
                first_bos,
                generation_stop_ids(loaded, tokenizer, None),
                config.chat_template,
                loaded.chat_template,
            )
            budget = memory_budget(config.max_memory_gb)
            executor = executor or LocalExecutor(default_workers(), budget, memory)
            shards, qnn_summary, runs = lower_all(
                loaded, specs, placements, config, tokenizer, folder, first_bos, cache, executor, watch
            )
            with watch.stage("write"):
                if tokenizer is not None:
                    (folder / tokenizer.path.name).write_bytes(tokenizer.path.read_bytes())
                manifest_write.write(folder, build_manifest(loaded, tokenizer, chat, config, shards, qnn_summary))
                staging.replace_folder(folder, output)
        except BaseException as error:
            shutil.rmtree(folder, ignore_errors=True)
            staging.finished(folder)
            if isinstance(error, JobFailed):
                raise Failure(
                    f"lowering {error}; the export's processes held {gb(memory.peak)} at their peak "
                    f"(this machine has {gb(meminfo('MemTotal'))}); nothing was written"
                ) from None
            raise
    peaks = (memory.peak, memory.peak_of(os.getpid()))
    seconds = time.perf_counter() - started
    print_summary(shards, runs, watch, peaks, seconds, output, qnn_summary, htp)
    if summary is not None:
        write_summary(summary, shards, runs, watch, peaks, seconds, output)
    return output


def plan(args, config: ExportConfig, placements: list[Placement]) -> list[ShardSpec]:
    """The shards: layers as config.layers_per_shard says; `auto` fills the QNN shards up to
    their HTP budget (split/plan.py, split/htp_limits.py)."""
    if config.layers_per_shard != "auto":
        return plan_shards(args, config.shards, config.layers_per_shard)
    n = config.shards
    capacity = [
        layer_capacity(args, ShardSpec(i, 0, 0, i == 0, i == n - 1), p.options, config.max_seq_len, config.methods())
        if p.backend == "qnn"
        else None
        for i, p in enumerate(placements)
    ]
    counts = auto_layer_counts(args, capacity)
    print(f"note: layers_per_shard auto: {counts}", file=sys.stderr)
    return plan_shards(args, n, counts)


def terminated(signum: int, cached: bool) -> None:
    """Clean up here and leave at once. An exception raised from a signal handler can land where
    Python ignores it (a fork hook, a finalizer), and the export would carry on."""
    ForkedCall.kill_all()
    staging.remove_unfinished()
    kept = "; the shards lowered so far are in the shard cache: the same command resumes" if cached else ""
    quiet.say_at_once(f"error: the export was stopped ({signal.Signals(signum).name}); nothing was written{kept}")
    os._exit(128 + signum)


@exits_cleanly
def main(argv=None) -> None:
    args = config_flags.parse_args(argv)
    cache = None if args.no_cache else ShardCache.from_environment()
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated(signum, cached=cache is not None))
    config = config_flags.config_from_flags(args)
    if any(p.backend == "qnn" for p in config.placements()):
        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    executor = from_ray_flag(args.ray)
    try:
        with quiet.filtered_native_stderr(args.verbose):
            run_export(
                config,
                cache,
                executor,
                summary=Path(args.json) if args.json else None,
            )
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(
                f"out of disk space while writing the export ({e.filename or 'artifacts'}); nothing was replaced"
            ) from None
        raise


if __name__ == "__main__":
    main()
