"""The wall time an export would take on N workers, modelled from one run's measured jobs.

    python -m composite.export ... --json run.json
    python scripts/cluster_model.py run.json [--workers 1,2,4,8,16]

Reads the export's --json summary (each lowering job's and float pass's seconds and the jobs it
waited for), and schedules the same jobs on N identical workers the way the executors do: in the
export's order, each job as soon as the jobs it needs are done and a worker is free. Prints, per N,
the modelled wall time of the lowering stage, and the two bounds it lies between: the critical path
(the longest chain of jobs that wait for each other, the wall time with workers enough) and the
total work divided by N. The model leaves out what a cluster adds (sending a shard's weights
through the object store, starting a worker process) and what the export does before and after
its jobs (opening the checkpoint, cache keys, spill-fill, writing): the summary's own stages.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path


def jobs_of(summary: dict) -> list[dict]:
    """{"job", "needs", "seconds"} of every job the export ran, float passes first (their order)."""
    jobs = [run for run in summary.get("float_jobs", [])]
    for shard in summary["shards"]:
        if shard.get("job"):
            # A summary written before jobs recorded their needs: right for shards that need none.
            jobs.append({"job": f"lower shard {shard['index']}", "needs": [], **shard["job"]})
            if "float_jobs" not in summary and "qnn" in shard.get("backends", []):
                raise SystemExit("error: this summary has no job dependencies: export again with this version's --json")
    return jobs


def schedule(jobs: list[dict], workers: int) -> float:
    """Wall time of running `jobs` in order on `workers`, each when its needs are done."""
    finished: dict[str, float] = {}
    free = [0.0] * workers  # when each worker is next free
    heapq.heapify(free)
    pending = list(jobs)
    while pending:
        ready = [j for j in pending if all(n in finished for n in j["needs"])]
        job = min(ready, key=lambda j: max([finished[n] for n in j["needs"]], default=0.0))
        pending.remove(job)
        start = max(heapq.heappop(free), max([finished[n] for n in job["needs"]], default=0.0))
        finished[job["job"]] = start + job["seconds"]
        heapq.heappush(free, finished[job["job"]])
    return max(finished.values(), default=0.0)


def critical_path(jobs: list[dict]) -> float:
    done: dict[str, float] = {}
    for job in jobs:  # the export lists a job after the jobs it needs
        done[job["job"]] = job["seconds"] + max([done[n] for n in job["needs"]], default=0.0)
    return max(done.values(), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("summary", help="an export's --json summary")
    p.add_argument("--workers", default="1,2,4,8,16", help="comma separated worker counts")
    args = p.parse_args()
    path = Path(args.summary)
    if not path.is_file():
        sys.exit(f"error: no such file: {path}")
    summary = json.loads(path.read_text())
    jobs = jobs_of(summary)
    total = sum(job["seconds"] for job in jobs)
    longest = critical_path(jobs)
    print(f"{len(jobs)} jobs, {total / 60:.1f} min of work, critical path {longest / 60:.1f} min")
    print(
        f"measured: lowering stage {summary['stages'].get('lowering', 0) / 60:.1f} min, export {summary['seconds'] / 60:.1f} min"
    )
    print("| workers | modelled lowering stage | total work / workers |")
    print("|---:|---:|---:|")
    for n in (int(x) for x in args.workers.split(",")):
        print(f"| {n} | {schedule(jobs, n) / 60:.1f} min | {total / n / 60:.1f} min |")


if __name__ == "__main__":
    main()
