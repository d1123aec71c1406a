"""What an export prints when it is done: a row per shard, where the time and the memory went."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from composite import manifest_files
from composite.config import Placement
from composite.errors import UserError
from composite.memory import Stopwatch, gb
from composite.units import MB, MIB


@dataclass
class JobRuns:
    """How the export's jobs ran: {"job", "needs", "seconds", "where", "peak_bytes", "stages"} each."""

    shards: dict[int, dict] = field(default_factory=dict)  # shard index -> its lowering job
    float_passes: list[dict] = field(default_factory=list)  # the calibration chain's float passes

    def every(self) -> list[dict]:
        return [*self.shards.values(), *self.float_passes]


def format_sqnr(db: float | None) -> str:
    return "exact" if db is None or db == float("inf") else f"{db:.1f}"


def layers_text(shard: dict) -> str:
    first, end = shard["layers"]
    parts = (
        (["emb"] if shard["has_embedding"] else [])
        + ([f"L{first}" if end - first == 1 else f"L{first}-L{end - 1}"] if end > first else [])
        + (["head"] if shard["has_head"] else [])
    )
    return " ".join(parts)


def print_htp(shards: list[dict], estimates: dict | None) -> None:
    """Each QNN shard's bytes on the HTP as lowered (context binaries, its own spill-fill need,
    I/O), against its budget; the shards' sum against one process's HTP address space."""
    from composite.qnn_soc import htp_arch
    from composite.split.htp_limits import PROCESS_MIB, HtpBytes, context_limit

    total = 0
    for s in shards:
        if s["placement"]["backend"] != "qnn" or "htp_context_bytes" not in s:
            continue
        options = s["placement"]["options"]
        estimate = (estimates or {}).get(s["index"])
        io = estimate.io if estimate else 0
        measured = HtpBytes(s["htp_context_bytes"], s.get("spill_fill_bytes", 0), io)
        total += measured.total
        before = f"; {estimate.total / MIB:.1f} MiB estimated before lowering" if estimate else ""
        print(
            f"HTP: shard {s['index']} ({options['soc']}, v{htp_arch(options['soc'])}) holds {measured.describe()} of "
            f"its {context_limit(options) // MIB} MiB budget{before}"
        )
    if total:
        print(f"HTP: the QNN shards hold {total / MIB:.1f} MiB together, of the {PROCESS_MIB} MiB one process may map")


def print_summary(
    shards: list[dict],
    runs: JobRuns,
    watch: Stopwatch,
    peak_bytes: tuple[int | None, int | None],
    total_seconds: float,
    output: Path,
    qnn_summary: dict | None,
    htp: dict | None = None,
) -> None:
    """One row per shard. seconds: the shard's lowering job, start to result; peak: the PSS of the
    process that lowered it, at its highest. peak_bytes: (the summed PSS of all the export's
    processes at its highest, the main process's own). cache: "hit" (taken from the shard cache),
    "stored" (lowered and put there) or "off". SQNR (dB, against the float shard on a held-out
    input) is given for the shard's main output per method, decode/prefill, over the whole output
    and for its worst token; the manifest has the first for every output."""
    rows = [("shard", "layers", "backend", "delegates", "size", "seconds", "peak", "cache", "SQNR dB", "worst token")]
    for s in shards:
        run = runs.shards.get(s["index"], {})
        backend = Placement(s["placement"]["backend"], s["placement"]["options"]).describe()
        sqnr = (
            "/".join(format_sqnr(next(iter(per_output.values()))) for per_output in s["sqnr_db"].values())
            if "sqnr_db" in s
            else "-"
        )
        worst = (
            "/".join(format_sqnr(v) for v in s["sqnr_worst_token_db"].values()) if "sqnr_worst_token_db" in s else "-"
        )
        rows.append(
            (
                str(s["index"]),
                layers_text(s),
                backend,
                ",".join(s["backends"]) or "none",
                f"{s['size'] / MB:.2f} MB",
                f"{run['seconds']:.1f}" if run else "-",
                gb(run["peak_bytes"]) if run.get("peak_bytes") else "-",
                s.get("cache", "-"),
                sqnr,
                worst,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for s in shards:
        for note in s["notes"]:
            print(f"note: shard {s['index']}: {note}")
    stages: dict[str, float] = {}
    for run in runs.every():
        for name, seconds in run["stages"].items():
            stages[name] = stages.get(name, 0.0) + seconds
    if stages:
        print(
            "lowering jobs' time by stage (summed over shards): "
            + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items())
        )
    print("export's wall time by stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in watch.seconds.items()))
    if qnn_summary is not None:
        print_htp(shards, htp)
        print(
            f"QNN {qnn_summary['build_id']} ({qnn_summary['libraries']}); shared spill-fill buffer "
            f"{qnn_summary['spill_fill_bytes']} bytes"
        )
    total = manifest_files.stored_bytes(shards)
    hits = sum(s.get("cache") == "hit" for s in shards)
    reused = f" ({hits} of them from the cache)" if hits else ""
    every, own = peak_bytes
    print(
        f"{len(shards)} shards{reused}, {total / MB:.2f} MB, {total_seconds:.1f} s, peak memory {gb(every)} "
        f"(summed PSS of the export's processes; {gb(own)} its main process) -> {output}"
    )


def write_summary(path: Path, shards, runs: JobRuns, watch, peaks, seconds: float, output: Path) -> None:
    """--json: the summary print_summary shows, for scripts (scripts/scale_probe.py reads it)."""
    keep = (
        "index",
        "file",
        "size",
        "data",
        "layers",
        "backends",
        "cache",
        "spill_fill_bytes",
        "htp_context_bytes",
        "sqnr_db",
    )
    document = {
        "output": str(output),
        "seconds": round(seconds, 2),
        "peak_bytes": peaks[0],
        "main_process_peak_bytes": peaks[1],
        "stages": {k: round(v, 2) for k, v in watch.seconds.items()},
        "shards": [{**{k: s[k] for k in keep if k in s}, "job": runs.shards.get(s["index"])} for s in shards],
        "float_jobs": runs.float_passes,
    }
    try:
        Path(path).write_text(json.dumps(document, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"cannot write --json {path}: {e.strerror}") from None


class JobProgress:
    """The bar of the export's lowering jobs: how many are done, and which are running now (on
    this machine or across a Ray cluster)."""

    def __init__(self, jobs: list, desc: str = "lowering shards"):
        self.names = {job.name for job in jobs}
        self.running: list[str] = []
        self.bar = tqdm(total=len(jobs), desc=desc, unit="shard", file=sys.stderr, disable=not jobs)

    def started(self, job) -> None:
        if job.name in self.names:
            self.running.append(job.label or job.name)
            self._show()

    def finished(self, job) -> None:
        if job.name in self.names:
            self.running.remove(job.label or job.name)
            self.bar.update()
            self._show()

    def _show(self) -> None:
        self.bar.set_postfix_str(f"running: {', '.join(self.running)}" if self.running else "", refresh=True)

    def close(self) -> None:
        self.bar.close()
