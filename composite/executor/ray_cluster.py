"""Jobs on a Ray cluster (`--ray [ADDRESS]`; the optional extra: pip install -e '.[cluster]').

The same jobs as the local executor's, as Ray tasks: one CPU each, Ray's `memory` resource set to
the job's expected peak so that Ray packs them onto nodes that hold them, and a fresh worker
process per task (max_calls=1: what a lowering leaves in its process goes with it). Workers need
no shared filesystem and no copy of the checkpoint: a job's weights travel through the object
store (each shard's part of the checkpoint, read when the job is submitted), and so do the float
streams a QNN shard is calibrated with; the .pte bytes come back with the results and this process
writes them. A worker that dies is retried by Ray (the result is the same: a job's bytes do not
depend on where it runs); a job submitted only when its inputs are done and a worker would be
free keeps one shard's weights or so in the object store at a time.

Workers import this package (install it on every node) and, for QNN shards, must have the QNN host
libraries on their loader path: start `ray start` after `eval "$(python -m composite.qnn_host env)"`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import urllib.parse

from composite.errors import UserError
from composite.executor import Done, Job, JobFailed, OnDone, Result, order_check
from composite.memory import PeakMemory


def run_job(fn, *args):
    """A job in a Ray worker: -> (its result, where it ran, seconds, the worker's peak PSS)."""
    started = time.perf_counter()
    with PeakMemory() as memory:
        result = fn(*args)
    return result, f"{socket.gethostname()}:{os.getpid()}", time.perf_counter() - started, memory.peak


def connect(address: str | None):
    """ray.init on an existing cluster: ADDRESS, else RAY_ADDRESS, else the one running on this
    machine. One line (exit 2) when Ray is not installed or nothing answers, before any work."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install -e '.[cluster]' (or pip install ray)") from None
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    host = urllib.parse.urlsplit(f"//{address}").hostname if address != "auto" else None
    options = {"_node_ip_address": "127.0.0.1"} if host in ("127.0.0.1", "localhost") else {}
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", **options)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"no Ray cluster answers at {address}: {first}") from None
    return ray


class RayExecutor:
    shares_files = False  # workers send the .pte bytes back

    def __init__(self, address: str | None = None, window: int | None = None):
        self.ray = connect(address)
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        resources = self.ray.cluster_resources()
        self.cpus = int(resources.get("CPU", 1))
        self.node_memory = max(
            (node["Resources"].get("memory", 0) for node in self.ray.nodes() if node.get("Alive")), default=0
        )
        self.budget = None  # Ray packs by each job's `memory`
        self.window = window or self.cpus + 1

    def check_fits(self, jobs: list[Job]) -> None:
        """A job no node can hold would wait forever in Ray's queue: one line instead."""
        for job in jobs:
            if self.node_memory and job.memory > self.node_memory:
                raise UserError(
                    f"{job.label} is expected to need about {job.memory / 1e9:.1f} GB, more than any node of the Ray "
                    f"cluster offers ({self.node_memory / 1e9:.1f} GB): cut the model into more shards"
                )

    def portable(self, arg):
        """A job argument as a worker without this machine's files takes it."""
        from composite.lowering.task import ShardWork
        from composite.model.loaded import part_names

        if isinstance(arg, ShardWork):
            spec = arg.spec
            names = part_names(arg.args, spec.has_embedding, spec.layers, spec.has_head)
            return dataclasses.replace(arg, weights=arg.weights.detached(names), output=None)
        return arg

    def run(self, jobs: list[Job], on_done: OnDone) -> None:
        ray = self.ray
        order_check(jobs)
        self.check_fits(jobs)
        task = ray.remote(run_job)
        submitted: dict[str, object] = {}  # job name -> ObjectRef of its result
        done: set[str] = set()
        running: dict[object, Job] = {}
        pending = list(jobs)
        try:
            while pending or running:
                for job in list(pending):
                    if len(running) >= self.window:
                        break
                    if all(n in done for n in job.needs):
                        pending.remove(job)
                        args = [submitted[a.name] if isinstance(a, Result) else self.portable(a) for a in job.args]
                        options = {"num_cpus": 1, "max_retries": 3, "retry_exceptions": False, "max_calls": 1}
                        if job.memory:
                            options["memory"] = job.memory
                        ref = task.options(name=job.name, **options).remote(job.fn, *args)
                        submitted[job.name] = ref
                        running[ref] = job
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    job = running.pop(ref)
                    result, where, seconds, peak = self._get(ref, job)
                    done.add(job.name)
                    on_done(Done(job, result, seconds, where, peak))
        except (ray.exceptions.RaySystemError, ConnectionError) as e:
            raise UserError(f"the Ray cluster at {self.address} went away: {str(e).strip().splitlines()[0]}") from None
        finally:
            for ref in running:
                ray.cancel(ref, force=True)

    def _get(self, ref, job: Job):
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            raise RuntimeError(f"{job.label} failed on the Ray cluster:\n{e}") from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError) as e:
            raise JobFailed(job, f"its Ray worker died after Ray's retries ({type(e).__name__})") from None
