"""One spill-fill buffer for every QNN shard of an export, settled once all of them are written.

Each QNN shard is lowered with the spill-fill size its own contexts need. On a device the HTP
backend keeps one process-wide buffer, as large as the largest any context asks for, so every QNN
shard's file is given that size (lowering/qnn/pte.py's with_spill_fill: its compile specs only)
and its manifest entry the new file's size and sha256.
"""

from __future__ import annotations

from pathlib import Path

from composite import manifest_files, qnn_host
from composite.lowering.qnn.pte import with_spill_fill


def settle(folder: Path, entries: list[dict], job_stages: list[dict]) -> dict:
    """Every QNN shard among the manifest `entries` (files in `folder`) given the largest size any
    of them needs; each entry's own "spill_fill_bytes" stays its own need. job_stages: the stages
    (name -> seconds) of the jobs this export ran. -> the manifest's qnn summary."""
    qnn = [e for e in entries if e["placement"]["backend"] == "qnn"]
    shared = max((e["spill_fill_bytes"] for e in qnn), default=0)
    for entry in qnn:
        if entry["spill_fill_bytes"] != shared:
            path = folder / entry["file"]
            path.write_bytes(with_spill_fill(path.read_bytes(), shared))
            entry["sha256"], entry["size"] = manifest_files.sha256_file(path), path.stat().st_size
    calibration = [stages["calibrate"] for stages in job_stages if "calibrate" in stages]
    host = qnn_host.prepare()
    return {
        "build_id": host.build_id,
        "libraries": host.source,
        "spill_fill_bytes": shared,
        "calibration_seconds": round(sum(calibration), 2) if calibration else None,
    }
