"""Jobs on a Ray cluster (`--ray [ADDRESS]`; the optional extra: pip install -e '.[cluster]').

The same jobs as the local executor's, as Ray tasks: one CPU each, Ray's `memory` resource set to
the job's expected peak so that Ray packs them onto nodes that hold them, and a fresh worker
process per task (max_calls=1: what a lowering leaves in its process goes with it) unless the job
says it leaves nothing behind (Job.own_process). Workers need
no shared filesystem and no copy of the checkpoint: a job's weights travel through the object
store (each shard's part of the checkpoint, read when the job is submitted), and so do the float
streams a QNN shard is calibrated with; the .pte bytes come back with the results and this process
writes them. A worker that dies is retried by Ray (the result is the same: a job's bytes do not
depend on where it runs); a job submitted only when its inputs are done and a worker would be
free keeps one shard's weights or so in the object store at a time. Tensors travel without copies
(views of the object store in the worker, read-only): jobs never write into their arguments.

Workers import this package (install it on every node) and, for QNN shards, must have the QNN host
libraries on their loader path: start `ray start` after `eval "$(python -m composite.qnn_host env)"`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import socket
import time
import urllib.parse
from pathlib import Path

from composite.errors import UserError
from composite.executor import Done, Job, JobFailed, OnDone, OnStart, Result, order_check
from composite.executor.fork import ForkedCall, as_message, raise_message
from composite.memory import PeakMemory


def from_ray_flag(flag: str | None):
    """The executor --ray [ADDRESS] asks for: None without the flag (the caller's local default),
    else a RayExecutor, connected now, so that a missing Ray or a silent address is one line
    before any work ("" = RAY_ADDRESS, else the cluster running on this machine)."""
    return None if flag is None else RayExecutor(flag or None)


@dataclasses.dataclass(frozen=True)
class Shared:
    """An argument many jobs take, in the object store once. Wrapped, so that Ray hands the job
    its reference rather than a fresh copy: a worker that runs several such jobs reads it once."""

    ref: object  # ray.ObjectRef


_shared_in_this_worker: dict[str, object] = {}  # the last Shared argument read here, by object id


def _value_of(arg):
    if not isinstance(arg, Shared):
        return arg
    key = arg.ref.hex()
    if key not in _shared_in_this_worker:
        import ray

        _shared_in_this_worker.clear()  # one at a time: a worker holds one run's float model
        _shared_in_this_worker[key] = ray.get(arg.ref)
    return _shared_in_this_worker[key]


def run_job(fn, *args):
    """A job in a Ray worker: -> (its result, (where it ran, seconds, the worker's peak PSS)), two
    objects, so that a job taking this one's result takes it alone."""
    started = time.perf_counter()
    with PeakMemory() as memory:
        result = fn(*map(_value_of, args))
    return result, (f"{socket.gethostname()}:{os.getpid()}", time.perf_counter() - started, memory.peak)


def address_of(address: str | None) -> str:
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def check_answers(address: str) -> None:
    """A cluster's head answers at once; ray.init would retry for minutes."""
    if address == "auto" or "://" in address:
        return
    parts = urllib.parse.urlsplit(f"//{address}")
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=5):
            pass
    except (OSError, ValueError) as e:
        raise UserError(f"no Ray cluster answers at {address}: {e}") from None


def import_ray():
    # Tensors put in the object store are read back as views of it rather than copies (Ray's own
    # switch, read when Ray is imported; what it saves: docs/cluster.md, Results). A job must
    # therefore not write into the tensors it is given.
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install -e '.[cluster]' (or pip install ray)") from None
    return ray


def connect(address: str):
    """ray.init on an existing cluster (in the process that will be Ray's driver)."""
    ray = import_ray()
    options = {}
    if address != "auto" and urllib.parse.urlsplit(f"//{address}").hostname in ("127.0.0.1", "localhost"):
        options["_node_ip_address"] = "127.0.0.1"
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", **options)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"no Ray cluster answers at {address}: {first}") from None
    return ray


def cluster_facts(address: str) -> tuple[int, int]:
    """(CPUs, the most memory one node offers) of the cluster."""
    ray = connect(address)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    memory = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    return cpus, int(memory)


class RayExecutor:
    """The export's process never joins the cluster itself: Ray's core ends a driver whose
    cluster goes away. A forked child is Ray's driver, and sends each finished job back through a
    pipe; a child that dies is a cluster that went away, reported in one line."""

    shares_files = False  # workers send the .pte bytes back

    def __init__(self, address: str | None = None):
        import_ray()
        self.address = address_of(address)
        check_answers(self.address)
        self.cpus, self.node_memory = _in_child(cluster_facts, self.address)  # one line now if nothing answers
        self.budget = None  # Ray packs by each job's `memory`
        self.window = self.cpus + 1

    def check_fits(self, jobs: list[Job]) -> None:
        """A job no node can hold would wait forever in Ray's queue: one line instead."""
        for job in jobs:
            if self.node_memory and job.memory > self.node_memory:
                raise UserError(
                    f"{job.label} is expected to need about {job.memory / 1e9:.1f} GB, more than any node of the Ray "
                    f"cluster offers ({self.node_memory / 1e9:.1f} GB): cut the model into more shards"
                )

    def run(self, jobs: list[Job], on_done: OnDone, on_start: OnStart | None = None) -> None:
        order_check(jobs)
        self.check_fits(jobs)
        by_name = {job.name: job for job in jobs}
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # Ray's driver
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.close(read)
            quiet_driver()
            with os.fdopen(write, "wb") as out:
                try:
                    drive(self.address, jobs, self.window, lambda *message: pickle.dump(message, out) or out.flush())
                    pickle.dump(("end",), out)
                except JobFailed as e:
                    pickle.dump(("job_failed", e.job.name, e.how), out)
                except BaseException as e:
                    pickle.dump(as_message(e), out)
                out.flush()
            os._exit(0)
        os.close(write)
        ForkedCall.running.add(pid)
        try:
            with os.fdopen(read, "rb") as pipe:
                while True:
                    try:
                        message = pickle.load(pipe)
                    except EOFError:
                        raise UserError(
                            f"the Ray cluster at {self.address} went away before the export was done; nothing was written"
                        ) from None
                    kind, *rest = message
                    if kind == "end":
                        return
                    if kind == "start":
                        if on_start is not None:
                            on_start(by_name[rest[0]])
                    elif kind == "done":
                        name, result, where, seconds, peak = rest
                        on_done(Done(by_name[name], result, seconds, where, peak))
                    elif kind == "job_failed":
                        raise JobFailed(by_name[rest[0]], rest[1])
                    else:
                        raise_message(kind, rest[0])
        finally:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            ForkedCall.running.discard(pid)


DRIVER_LOG = Path.home() / ".cache" / "composite" / "ray-driver.log"


def quiet_driver() -> None:
    """Ray's driver logs to its own file (DRIVER_LOG): its core prints pages when a cluster goes."""
    DRIVER_LOG.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(DRIVER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _in_child(fn, *args):
    """fn(*args) in a forked child (Ray's driver state stays out of this process)."""

    def quietly():
        quiet_driver()
        return fn(*args)

    return ForkedCall(quietly).result()


def portable(arg):
    """A job argument as a worker without this machine's files takes it: what its for_remote()
    gives, where it has one (a shard's work: its own part of the checkpoint, in memory)."""
    for_remote = getattr(arg, "for_remote", None)
    return for_remote() if callable(for_remote) else arg


def drive(address: str, jobs: list[Job], window: int, report) -> None:
    """Ray's driver: submit each job when its inputs are done and a worker would be free (so
    about one shard's weights at a time wait in the object store); report("start", name) as each
    is submitted and report("done", name, result, where, seconds, peak) as it finishes."""
    ray = connect(address)
    in_own_process, in_a_shared_process = ray.remote(max_calls=1)(run_job), ray.remote(run_job)
    submitted: dict[str, object] = {}  # job name -> ObjectRef of its result
    # An argument several jobs take (composite.tune's float model and its pass over the text) is
    # put in the object store once.
    uses: dict[int, int] = {}
    for job in jobs:
        for a in job.args:
            uses[id(a)] = uses.get(id(a), 0) + 1
    shared: dict[int, object] = {}

    def argument(a):
        if isinstance(a, Result):
            return submitted[a.name]
        if uses[id(a)] > 1 and not isinstance(a, (type(None), bool, int, float, str)):
            if id(a) not in shared:
                shared[id(a)] = Shared(ray.put(a))
            return shared[id(a)]
        return portable(a)

    done: set[str] = set()
    running: dict[object, tuple[Job, object]] = {}  # its facts' ObjectRef -> (job, its result's)
    pending = list(jobs)
    try:
        while pending or running:
            for job in list(pending):
                if len(running) >= window:
                    break
                if all(n in done for n in job.needs):
                    pending.remove(job)
                    args = [argument(a) for a in job.args]
                    options = {"num_cpus": 1, "max_retries": 3, "retry_exceptions": False}
                    if job.memory:
                        options["memory"] = job.memory
                    task = in_own_process if job.own_process else in_a_shared_process
                    ref, facts = task.options(name=job.name, num_returns=2, **options).remote(job.fn, *args)
                    submitted[job.name] = ref
                    running[facts] = (job, ref)
                    report("start", job.name)
            ready, _ = ray.wait(list(running), num_returns=1)
            for facts in ready:
                job, ref = running.pop(facts)
                where, seconds, peak = _get(ray, facts, job)
                report("done", job.name, _get(ray, ref, job), where, seconds, peak)
                done.add(job.name)
    except (ray.exceptions.RaySystemError, ConnectionError) as e:
        raise UserError(f"the Ray cluster at {address} went away: {str(e).strip().splitlines()[0]}") from None


def _get(ray, ref, job: Job):
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, UserError):
            raise UserError(str(cause)) from None
        raise RuntimeError(f"{job.label} failed on the Ray cluster:\n{e}") from None
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError) as e:
        raise JobFailed(job, f"its Ray worker died after Ray's retries ({type(e).__name__})") from None
