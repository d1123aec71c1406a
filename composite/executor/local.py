"""Jobs in forked processes on this machine, as many at once as there are workers and as fit the
memory budget; workers = 0 runs them one after another in this process.

A child is forked when its job starts, so it inherits the inputs it needs (and nothing read later).
The export's own process stays light: it schedules, writes each result, and samples memory.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait

from composite.errors import UserError
from composite.executor import Done, Job, JobFailed, OnDone, OnStart, order_check, resolve
from composite.executor.fork import ForkedCall, ProcessDied
from composite.memory import PeakMemory


def default_workers() -> int:
    """COMPOSITE_EXPORT_WORKERS, else one per core (0: everything in this process)."""
    text = os.environ.get("COMPOSITE_EXPORT_WORKERS")
    if text is not None and text.strip().isdigit():
        return int(text)
    return os.cpu_count() or 1


class LocalExecutor:
    shares_files = True  # its jobs write into the export's folders themselves

    def __init__(self, workers: int, memory_budget: int | None = None, memory: PeakMemory | None = None):
        """memory_budget: bytes the running jobs' estimates may add up to (None: no limit); a job
        estimated above it still runs, alone. memory: the run's sampler, which tells each
        process's peak."""
        self.workers, self.budget, self.memory = workers, memory_budget, memory

    def check_fits(self, jobs: list[Job]) -> None:
        """One line, before any work, for a job expected to need more memory than the export may use."""
        for job in jobs:
            if self.budget is not None and job.memory > self.budget:
                raise UserError(
                    f"{job.label} is expected to need about {job.memory / 1e9:.1f} GB to lower, more than the "
                    f"{self.budget / 1e9:.1f} GB this export may use (--max-memory, or 90% of what is free): cut the "
                    "model into more shards (--shards, layers_per_shard) or allow more memory"
                )

    def run(self, jobs: list[Job], on_done: OnDone, on_start: OnStart | None = None) -> None:
        order_check(jobs)
        self.check_fits(jobs)
        on_start = on_start or (lambda job: None)
        if self.workers == 0:
            self._run_here(jobs, on_done, on_start)
        else:
            self._run_forked(jobs, on_done, on_start)

    def _run_here(self, jobs: list[Job], on_done: OnDone, on_start: OnStart) -> None:
        results: dict[str, object] = {}
        users = _users(jobs)
        for job in jobs:
            on_start(job)
            started = time.perf_counter()
            result = job.fn(*resolve(job.args, results))
            results[job.name] = result
            _forget_used(job, results, users)
            on_done(Done(job, result, time.perf_counter() - started, f"pid {os.getpid()}", None))

    def _fits(self, job: Job, running: dict) -> bool:
        if not running:
            return True
        if len(running) >= self.workers:
            return False
        return self.budget is None or sum(j.memory for j, _ in running.values()) + job.memory <= self.budget

    def _run_forked(self, jobs: list[Job], on_done: OnDone, on_start: OnStart) -> None:
        results: dict[str, object] = {}
        users = _users(jobs)
        pending = list(jobs)
        running: dict[ForkedCall, tuple[Job, float]] = {}
        try:
            while pending or running:
                for job in list(pending):
                    if all(n in results for n in job.needs) and self._fits(job, running):
                        pending.remove(job)
                        running[ForkedCall(job.fn, resolve(job.args, results))] = (job, time.perf_counter())
                        on_start(job)
                for call in wait(list(running)):
                    job, started = running.pop(call)
                    pid = call.pid
                    try:
                        result = call.result()
                    except ProcessDied as died:
                        raise JobFailed(job, died.how) from None
                    results[job.name] = result
                    _forget_used(job, results, users)
                    peak = self.memory.peak_of(pid) if self.memory is not None else None
                    on_done(Done(job, result, time.perf_counter() - started, f"pid {pid}", peak))
        finally:
            for call in running:
                call.stop()


def _users(jobs: list[Job]) -> dict[str, int]:
    """name -> how many jobs take its result."""
    count: dict[str, int] = {}
    for job in jobs:
        for name in job.needs:
            count[name] = count.get(name, 0) + 1
    return count


def _forget_used(job: Job, results: dict, users: dict[str, int]) -> None:
    """Let a result go once every job that takes it has it (a float stream, a lowered shard)."""
    for name in job.needs:
        users[name] -= 1
        if users[name] == 0:
            results.pop(name, None)
    if users.get(job.name, 0) == 0:
        results.pop(job.name, None)
