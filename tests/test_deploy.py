"""The on-device loop on this machine: deploy push / run over --transport local (the host runner
and the HTP simulator stand in for the phone), stats pulled back, rendered by composite.report;
and the errors a user meets with adb and QNN libraries."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from composite.report import read_stats, render
from conftest import REPO, RUNNER, one_error_line, run_cli, runner_built

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def deploy(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("composite.deploy", *args, env=env)


@pytest.fixture(scope="module")
def local_device(qnn_fp16_export, tmp_path_factory):
    if not runner_built():
        pytest.skip("composite_runner is not built (bash scripts/build_runner.sh build)")
    root = tmp_path_factory.mktemp("device")
    common = ["--transport", "local", "--local-root", str(root)]
    first = deploy("push", "--artifacts", str(qnn_fp16_export), *common)
    second = deploy("push", "--artifacts", str(qnn_fp16_export), *common)
    return root, common, first, second


def test_push_copies_everything_then_skips_unchanged_files(local_device, qnn_fp16_export):
    root, _, first, second = local_device
    assert first.returncode == 0, first.stderr
    manifest = json.loads((qnn_fp16_export / "manifest.json").read_text())
    device_dir = root / "data/local/tmp/composite"
    for shard in manifest["shards"]:
        assert (device_dir / shard["file"]).read_bytes() == (qnn_fp16_export / shard["file"]).read_bytes()
    assert (device_dir / "composite_runner").is_file()
    assert (device_dir / "qnn" / "libQnnHtp.so").is_file()  # QNN placement: runtime libraries go too
    for library in (
        "libexecutorch.so",
        "libexecutorch_backend_qnn.so",
        "libexecutorch_kernels_optimized.so",
        "libsentencepiece.so.0",
        "libpcre2-8.so.0",
        "libcrypto.so.3",
    ):  # the runner's own closure
        assert (device_dir / library).is_file(), library
    assert not (device_dir / "libc.so.6").exists() and not (device_dir / "libstdc++.so.6").exists()
    pushed = int(first.stdout.split()[1])
    assert pushed >= len(manifest["shards"]) + 3
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("pushed 0 files") and f"skipped {pushed} unchanged" in second.stdout


def test_run_pulls_stats_that_render_one_entry_per_shard(local_device, tmp_path):
    _, common, first, _ = local_device
    assert first.returncode == 0, first.stderr
    stats_path = tmp_path / "stats.json"
    # A fresh shell: no loader path and none of the QNN set-up variables; the pushed libraries must do.
    env = {
        k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH" and not k.startswith(("QNN_", "COMPOSITE_QNN"))
    }
    run = deploy(
        "run",
        *common,
        "--prompt",
        "Once upon a time",
        "--stats-out",
        str(stats_path),
        "--",
        "--max_new_tokens",
        "8",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    stats = json.loads(stats_path.read_text())
    assert len(stats["tokens"]) == 8
    assert "QnnBackend" in stats["shard_backends"]

    report = subprocess.run(
        [sys.executable, "-m", "composite.report", str(stats_path), "--png", str(tmp_path / "r.png")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert report.stdout.count("| stats |") == len(stats["shard_backends"]) + 2  # shards, KV update, total

    plotted = render([read_stats(stats_path)], tmp_path / "again.png")
    for phase in ("decode", "prefill"):
        segments = plotted[phase]["stats"]
        assert [name for name, _ in segments[:-1]] == [f"{i} {layer}" for i, layer in enumerate(stats["shard_layers"])]
        assert segments[-1][0] == "KV update"
    assert [ms for _, ms in plotted["decode"]["stats"][:-1]] == stats["shard_ms_per_token"]


def test_run_passes_a_chat_through_stdin(local_device, tmp_path):
    _, common, first, _ = local_device
    assert first.returncode == 0, first.stderr
    stats_path = tmp_path / "chat.json"
    flags = ["--stats-out", str(stats_path), "--", "--max_new_tokens", "4", "--system", "Be brief."]
    run = subprocess.run(
        [sys.executable, "-m", "composite.deploy", "run", *common, "--chat", *flags],
        input="Hello robot\nTell me more\n",
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    turns = json.loads(stats_path.read_text())["turns"]
    assert len(turns) == 2 and turns[0]["start_pos"] == 0 and turns[1]["start_pos"] > len(turns[0]["prompt"])
    assert turns[1]["prompt_tokens"] < turns[1]["start_pos"]  # the second turn prefills only itself


def test_push_and_run_an_evaluation_with_its_kld_base(local_device, qnn_fp16_export, tmp_path):
    _, common, _, _ = local_device
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the device scores this text against the float model"] * 12))
    base = tmp_path / "base.kld"
    window = ["--ctx", "24", "--limit-tokens", "48"]
    on_host = run_cli(
        "composite.eval",
        "--artifacts",
        str(qnn_fp16_export),
        "--text",
        str(text),
        *window,
        "--reference",
        "eager",
        "--kld-base-out",
        str(base),
        "--json",
        check=True,
    )
    pushed = deploy(
        "push", "--artifacts", str(qnn_fp16_export), *common, "--eval-text", str(text), "--kld-base", str(base)
    )
    assert pushed.returncode == 0, pushed.stderr
    stats_path = tmp_path / "eval.json"
    runner_window = ["--ctx", "24", "--limit_tokens", "48"]
    flags = ["--eval-text", text.name, "--kld-base", base.name, "--stats-out", str(stats_path), "--", *runner_window]
    ran = deploy("run", *common, *flags)
    assert ran.returncode == 0, ran.stderr
    device, host = json.loads(stats_path.read_text()), json.loads(on_host.stdout)
    assert device["tokens"] == host["tokens"] == 2 * 23
    assert device["perplexity"] == pytest.approx(host["perplexity"], rel=1e-3)
    assert device["kld_mean"] == pytest.approx(host["kld_mean"], rel=1e-2, abs=1e-6)
    missing = deploy("run", *common, "--kld-base", base.name, "--prompt", "hi")
    assert "--kld-base is for --eval-text" in missing.stderr and missing.returncode == 2


def fake_adb(folder, devices: list[str]):
    """An adb on PATH that lists `devices` and fails anything else."""
    folder.mkdir(exist_ok=True)
    listing = "\\n".join(f"{d}\\tdevice" for d in devices)
    script = folder / "adb"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = devices ]; then printf "List of devices attached\\n{listing}\\n"; exit 0; fi\nexit 1\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{folder}:/usr/bin:/bin"}


def test_missing_adb_says_how_to_get_it(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no adb anywhere
    line = one_error_line(deploy("run", "--prompt", "hi", env=env))
    assert "adb not found" in line and "apt-get install adb" in line


def test_no_device_connected(tmp_path):
    line = one_error_line(deploy("run", "--prompt", "hi", env=fake_adb(tmp_path / "bin", [])))
    assert "no Android device connected" in line


def test_unknown_serial_names_the_connected_ones(tmp_path):
    env = fake_adb(tmp_path / "bin", ["R5CT123", "emulator-5554"])
    line = one_error_line(deploy("run", "--prompt", "hi", "--serial", "XYZ", env=env))
    assert "'XYZ' is not connected" in line and "R5CT123" in line
    line = one_error_line(deploy("run", "--prompt", "hi", env=env))
    assert "choose one with --serial" in line


def test_missing_qnn_libraries_for_the_soc_are_named(qnn_fp16_export, tmp_path):
    sdk = tmp_path / "sdk"
    (sdk / "lib/aarch64-android").mkdir(parents=True)
    (sdk / "lib/aarch64-android/libQnnHtp.so").write_bytes(b"")
    env = {**fake_adb(tmp_path / "bin", ["R5CT123"]), "QNN_SDK_ROOT": str(sdk)}
    line = one_error_line(deploy("push", "--artifacts", str(qnn_fp16_export), "--runner", str(RUNNER), env=env))
    assert "SM8650" in line and "libQnnHtpV75Skel.so" in line and "libQnnSystem.so" in line
    env.pop("QNN_SDK_ROOT")
    line = one_error_line(deploy("push", "--artifacts", str(qnn_fp16_export), "--runner", str(RUNNER), env=env))
    assert "set QNN_SDK_ROOT" in line


def test_push_names_a_runner_library_it_cannot_find_and_pushes_nothing(default_exports, tmp_path):
    """A runner linked against a library that is neither on this machine nor a system library."""
    source = tmp_path / "helper.c"
    source.write_text("int composite_helper(void) { return 7; }\n")
    runner_c = tmp_path / "runner.c"
    runner_c.write_text("int composite_helper(void);\nint main(void) { return composite_helper() - 7; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcomposite_helper.so"), str(source)], check=True)
    subprocess.run(
        ["cc", "-o", str(tmp_path / "composite_runner"), str(runner_c), f"-L{tmp_path}", "-lcomposite_helper"],
        check=True,
    )
    (tmp_path / "libcomposite_helper.so").unlink()
    root = tmp_path / "device"
    line = one_error_line(
        deploy(
            "push",
            "--artifacts",
            str(default_exports[3]),
            "--transport",
            "local",
            "--local-root",
            str(root),
            "--runner",
            str(tmp_path / "composite_runner"),
        )
    )
    assert "libcomposite_helper.so" in line and "--library-path" in line
    assert not root.exists()


def test_qnn_libraries_of_another_version_are_refused_by_push_and_by_the_runner(qnn_fp16_export, tmp_path):
    """An export compiled with QNN v2.37 meets this host's libraries (and a phone SDK's, read from
    the library's bytes): deploy push and composite_runner each refuse in one line naming both."""
    if not runner_built():
        pytest.skip("composite_runner is not built (bash scripts/build_runner.sh build)")
    older = "v2.37.0.250724175447"
    folder = tmp_path / "older"
    folder.mkdir()
    for item in qnn_fp16_export.iterdir():
        (folder / item.name).symlink_to(item)
    manifest = json.loads((qnn_fp16_export / "manifest.json").read_text())
    ours = manifest["qnn"]["build_id"]
    manifest["qnn"]["build_id"] = older
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    local = ["--transport", "local", "--local-root", str(tmp_path / "device")]
    line = one_error_line(deploy("push", "--artifacts", str(folder), *local))
    assert older in line and ours in line and "--allow-qnn-mismatch" in line
    assert not (tmp_path / "device").exists()  # nothing pushed
    assert deploy("push", "--artifacts", str(folder), *local, "--allow-qnn-mismatch").returncode == 0

    command = [str(RUNNER), "--artifacts", str(folder), "--prompt", "hi", "--max_new_tokens", "2"]
    line = one_error_line(subprocess.run(command, capture_output=True, text=True))
    assert older in line and ours in line and "--allow_qnn_mismatch" in line
    allowed = subprocess.run([*command, "--allow_qnn_mismatch"], capture_output=True, text=True)
    assert allowed.returncode == 0 and "warning: the QNN shards were compiled with QNN " + older in allowed.stderr

    # A phone's SDK: its libQnnHtp.so says which QNN it is in its bytes.
    sdk = tmp_path / "sdk"
    for path in ("lib/aarch64-android/libQnnHtp.so", "lib/aarch64-android/libQnnSystem.so",
                 "lib/aarch64-android/libQnnHtpV75Stub.so", "lib/hexagon-v75/unsigned/libQnnHtpV75Skel.so"):  # fmt: skip
        (sdk / path).parent.mkdir(parents=True, exist_ok=True)
        (sdk / path).write_bytes(b"\x7fELF ... QNN " + ours.encode() + b" ...")
    phone = {**fake_adb(tmp_path / "bin", ["R5CT123"]), "QNN_SDK_ROOT": str(sdk)}
    line = one_error_line(deploy("push", "--artifacts", str(folder), "--runner", str(RUNNER), env=phone))
    assert older in line and ours in line
