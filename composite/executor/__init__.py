"""Where an export's tasks run: the jobs, what they need, and the executors that run them.

A job is a module-level function and its arguments; an argument may be `Result(name)`, the result
of another job, which the executor hands over (locally: a forked child sees it in memory; on a
cluster: through the object store). An argument with a `for_remote()` method is sent to a process
on another machine as what that method gives (it detaches itself from this machine's files). Jobs come in the order they should start when several could;
each says how much memory it is expected to hold (`memory`, bytes), so an executor starts only
what fits. The local executor (local.py) runs them in forked processes on this machine, the Ray
executor (ray_cluster.py) on a Ray cluster; both call back with each result as it arrives, so the
caller writes and caches each shard as soon as it is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Result:
    """Stands for the result of the job named `name` in another job's arguments."""

    name: str


@dataclass
class Job:
    name: str  # unique in a run, e.g. "lower shard 3"
    fn: Callable  # module-level, so a remote worker can import it by name
    args: tuple = ()
    memory: int = 0  # expected peak bytes of the process running it
    label: str = ""  # what errors call it, e.g. "shard 3"
    # A lowering leaves memory behind in its process (allocator caches, compiled graphs): it runs in a
    # process of its own. A short job that leaves nothing (a tune measurement) may share a worker
    # process with the ones before it, which saves it the worker's start and its imports.
    own_process: bool = True
    needs: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        self.needs = tuple(a.name for a in self.args if isinstance(a, Result))


@dataclass
class Done:
    """A finished job, as the executor saw it."""

    job: Job
    result: object
    seconds: float  # wall time from start to result
    where: str  # the process (host:pid) or worker that ran it
    peak_bytes: int | None  # peak PSS of that process while it ran, where measured


class JobFailed(Exception):
    """A job's process or worker ended without a result (killed, lost): one line says which and how."""

    def __init__(self, job: Job, how: str):
        self.job, self.how = job, how
        super().__init__(f"{job.label or job.name}: {how}")


def resolve(args: tuple, results: dict[str, object]) -> tuple:
    return tuple(results[a.name] if isinstance(a, Result) else a for a in args)


def order_check(jobs: list[Job]) -> None:
    """Each job's needs come before it and exist (a job list is a plan: a mistake is a bug)."""
    seen = set()
    for job in jobs:
        missing = [n for n in job.needs if n not in seen]
        if missing:
            raise ValueError(f"job {job.name} needs {missing[0]}, which does not come before it")
        seen.add(job.name)


OnDone = Callable[[Done], None]
OnStart = Callable[[Job], None]  # a job handed to a process or worker (progress displays)
