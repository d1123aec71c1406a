"""--ray: exports and tuning on a Ray cluster give what the local default gives, byte for byte; a
worker killed mid-job is retried to the same result; a cluster that goes away, or none at all, is
one line. The cluster is this module's own: two nodes on 127.0.0.1 (ray start --head and a second
node, one CPU each, small object stores), stopped when the module is done."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DEBIAN_TEXT, MAX_SEQ_LEN, PREFILL_LEN, REPO, assert_clean_failure, qnn_fp16_cli, run_cli

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
NODE = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]
TEXT = DEBIAN_TEXT


def cluster_env() -> dict:
    # Every process of the cluster and its drivers agree on authentication (else InvalidAuthToken).
    return {**os.environ, "RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_stop() -> None:
    subprocess.run([*RAY, "stop", "--force"], env=cluster_env(), capture_output=True)


@pytest.fixture(scope="module")
def cluster(qnn_ready):
    """The address of a two-node Ray cluster on loopback (its workers inherit this process's
    environment, the QNN host libraries' loader path included)."""
    pytest.importorskip("ray")
    port = free_port()
    head = [*RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", *NODE]
    for command in (head, [*RAY, "start", f"--address=127.0.0.1:{port}", *NODE]):
        started = subprocess.run(command, env=cluster_env(), capture_output=True, text=True)
        if started.returncode != 0:
            ray_stop()
            pytest.fail(f"ray start failed: {started.stderr[-2000:]}")
    yield f"127.0.0.1:{port}"
    ray_stop()


def lowering_workers() -> list[int]:
    """Ray workers running a lowering job (Ray titles a worker's process ray::<task name>)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::lower shard"):
                    found.append(int(pid))
            except OSError:
                continue
    return found


def wait_for_a_lowering_worker(seconds: float = 180) -> int | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        workers = lowering_workers()
        if workers:
            return workers[0]
        time.sleep(0.2)
    return None


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, env={**cluster_env(), "COMPOSITE_CACHE": "off", **(env or {})})


def pte_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.pte"))}


def test_an_export_with_qnn_shards_on_the_cluster_is_the_local_export(workdir, cluster, tmp_path):
    local = qnn_fp16_cli(workdir)  # 6 shards: XNNPACK ends, four QNN fp16 shards
    config = local.folder.parent / "config.yaml"
    output, summary = tmp_path / "on_ray", tmp_path / "summary.json"
    result = cli(
        "composite.export", "--config", str(config), "--output", str(output), "--ray", cluster, "--json", str(summary)
    )
    assert result.returncode == 0, result.stderr
    assert pte_bytes(output) == pte_bytes(local.folder)
    jobs = [s["job"] for s in json.loads(summary.read_text())["shards"]]
    assert all(job["where"] and job["seconds"] > 0 for job in jobs)
    assert len({job["where"] for job in jobs}) == 6  # each shard in a Ray worker of its own


def test_a_worker_killed_mid_job_is_retried_to_the_same_bytes(default_exports, cluster, tmp_path):
    output = tmp_path / "retried"
    args = ["--shards", "3", "--max-seq-len", str(MAX_SEQ_LEN), "--prefill-len", str(PREFILL_LEN)]
    exporting = subprocess.Popen(
        [sys.executable, "-m", "composite.export", *args, "--output", str(output), "--ray", cluster],
        cwd=REPO,
        env={**cluster_env(), "COMPOSITE_CACHE": "off"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = wait_for_a_lowering_worker()
    if killed is not None:
        time.sleep(2)  # well into its job
        os.kill(killed, signal.SIGKILL)
    _, err = exporting.communicate(timeout=600)
    assert killed is not None, "no Ray worker ran a lowering job"
    assert exporting.returncode == 0, err
    assert pte_bytes(output) == pte_bytes(default_exports[3])


@pytest.mark.usefixtures("needs_debian_text")
def test_tune_on_the_cluster_writes_the_local_yaml(cluster, tmp_path):
    args = ["--text", str(TEXT), "--budget-mb", "1.6", "--ctx", "64", "--limit-tokens", "128", "--max-seq-len", "64"]
    args += ["--prefill-len", "16", "--shards", "4", "--candidates", "xnnpack:fp32,xnnpack:8da4w"]
    args += ["--embedding", "none|4,32", "--no-cache", "--artifacts", "artifacts/tuned"]
    configs = []
    for name, extra in (("local", []), ("ray", ["--ray", cluster])):
        (tmp_path / name).mkdir()
        output = tmp_path / name / "tuned.yaml"
        result = cli("composite.tune", *args, "--output", str(output), *extra)
        assert result.returncode == 0, result.stderr
        configs.append(output.read_text())
    assert configs[0] == configs[1]


def test_no_cluster_at_the_address_is_one_line_before_any_work(tmp_path):
    output = tmp_path / "out"
    result = cli("composite.export", "--shards", "2", "--output", str(output), "--ray", f"127.0.0.1:{free_port()}")
    assert_clean_failure(result, "no Ray cluster answers at 127.0.0.1:", output=output)


def test_without_ray_installed_ray_is_one_line(tmp_path):
    missing = tmp_path / "no_ray" / "ray"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('no module named ray')\n")
    pythonpath = os.pathsep.join([str(missing.parent), os.environ.get("PYTHONPATH", "")])
    output = tmp_path / "out"
    result = cli("composite.export", "--shards", "2", "--output", str(output), "--ray", env={"PYTHONPATH": pythonpath})
    assert_clean_failure(result, "--ray needs Ray: pip install", output=output)


def test_a_cluster_that_goes_away_ends_the_export_in_one_line(cluster, tmp_path):
    """Last in this module: it stops the cluster."""
    output = tmp_path / "out"
    export = subprocess.Popen(
        [sys.executable, "-m", "composite.export", "--shards", "3", "--quantize", "8da4w", "--output", str(output)]
        + ["--ray", cluster],
        cwd=REPO,
        # Ray's driver waits this long (60 s by default) for a lost head node to come back
        env={**cluster_env(), "COMPOSITE_CACHE": "off", "RAY_gcs_rpc_server_reconnect_timeout_s": "5"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_for_a_lowering_worker() is not None
    ray_stop()
    out, err = export.communicate(timeout=600)
    result = subprocess.CompletedProcess(export.args, export.returncode, out, err)
    assert_clean_failure(result, "the Ray cluster at", "went away", output=output)
