"""composite_runner cross-built for aarch64 (scripts/build_arm64.sh) and run under qemu-user: on an
emulated ARM64 CPU, XNNPACK takes its ARM kernel paths, and greedy tokens must still equal the x86
runner's. Emulation speed says nothing about a phone's.

scripts/test.sh builds the ARM64 runner and sets COMPOSITE_REQUIRE_ARM64=1, so in CI this runs or
fails; elsewhere it is skipped with the reason when the runner or qemu is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, RUNNER, run_cli

ARM_RUNNER = REPO / "build-arm64" / "composite_runner"
QEMU = shutil.which("qemu-aarch64-static")
NEW_TOKENS = 32
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def arm64_ready():
    missing = [
        what
        for what, ok in (
            ("scripts/build_arm64.sh has not built build-arm64/composite_runner", ARM_RUNNER.exists()),
            ("qemu-aarch64-static is not installed", QEMU is not None),
            ("build/composite_runner is not built", RUNNER.exists()),
        )
        if not ok
    ]
    if missing:
        if os.environ.get("COMPOSITE_REQUIRE_ARM64") == "1":
            pytest.fail("; ".join(missing))
        pytest.skip("; ".join(missing))


def generate(command: list[str], folder: Path, stats: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`command` (a runner, maybe under qemu) generates NEW_TOKENS greedy tokens from PROMPT."""
    flags = [
        "--artifacts",
        str(folder),
        "--prompt",
        PROMPT,
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--stats_json",
        str(stats),
    ]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tokens(command: list[str], folder: Path, stats: Path) -> tuple[list[int], float]:
    generate(command, folder, stats)
    data = json.loads(stats.read_text())
    return data["tokens"], data["decode_tokens_per_s"]


@pytest.mark.parametrize("quantize", ["none", "8da4w"])
def test_arm64_runner_generates_the_x86_tokens(arm64_ready, default_exports, default_8da4w_export, quantize, tmp_path):
    folder = default_exports[3] if quantize == "none" else default_8da4w_export
    # -L /: Debian's arm64 multiarch libraries are the guest's root (see scripts/build_arm64.sh).
    arm, arm_speed = tokens([QEMU, "-L", "/", str(ARM_RUNNER)], folder, tmp_path / "arm.json")
    x86, x86_speed = tokens([str(RUNNER)], folder, tmp_path / "x86.json")
    print(f"{quantize}: decode {arm_speed:.1f} tok/s emulated aarch64, {x86_speed:.1f} tok/s x86")
    assert len(arm) == NEW_TOKENS
    assert arm == x86


# What an aarch64 Linux device has without us: the loader and the C/C++ runtime (libc6:arm64,
# libstdc++6:arm64 from Debian's multiarch packages).
C_RUNTIME = (
    "ld-linux-aarch64.so.1",
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libstdc++.so.6",
    "libgcc_s.so.1",
)


def c_runtime_root(root: Path) -> Path:
    lib = root / "lib" / "aarch64-linux-gnu"
    lib.mkdir(parents=True)
    for name in C_RUNTIME:
        shutil.copy(Path("/usr/lib/aarch64-linux-gnu") / name, lib / name)
    (root / "lib" / "ld-linux-aarch64.so.1").symlink_to(f"aarch64-linux-gnu/{C_RUNTIME[0]}")
    return root


def test_pushed_bundle_starts_with_only_the_c_runtime(arm64_ready, default_exports, tmp_path):
    """deploy push of the aarch64 runner to a device-shaped folder, run under qemu with a root that
    holds only the C/C++ runtime and a loader path of the pushed folder alone: every other library
    must come from the push, and the tokens must be the x86 runner's."""
    folder = default_exports[3]
    device = tmp_path / "device"
    push = run_cli(
        "composite.deploy",
        "push",
        "--artifacts",
        str(folder),
        "--transport",
        "local",
        "--local-root",
        str(device),
        "--runner",
        str(ARM_RUNNER),
    )
    assert push.returncode == 0, push.stderr
    pushed = device / "data/local/tmp/composite"
    assert {"libexecutorch.so", "libexecutorch_backend_xnnpack.so", "libsentencepiece.so.0"} <= {
        p.name for p in pushed.iterdir()
    }
    root = c_runtime_root(tmp_path / "root")
    stats = tmp_path / "arm.json"
    env = {"LD_LIBRARY_PATH": str(pushed), "LD_DEBUG": "libs", "PATH": "/usr/bin:/bin"}
    result = generate([QEMU, "-L", str(root), str(pushed / "composite_runner")], pushed, stats, env=env)
    loaded = [
        line.split("calling init: ", 1)[1].strip() for line in result.stderr.splitlines() if "calling init: " in line
    ]
    assert any(path.endswith("/libexecutorch.so") for path in loaded)
    strays = [path for path in loaded if not path.startswith(str(pushed) + "/") and Path(path).name not in C_RUNTIME]
    assert not strays, f"loaded from outside the pushed folder: {strays}"
    x86, _ = tokens([str(RUNNER)], folder, tmp_path / "x86.json")
    assert json.loads(stats.read_text())["tokens"] == x86


def test_device_build_refuses_an_executorch_without_a_required_backend(arm64_ready, tmp_path):
    """The Android build requires xnnpack and qnn; the aarch64 wheel has no QNN backend, so asking
    this configuration for both is the host twin of an Android ExecuTorch built without QNN."""
    wheel = next((REPO / "build-arm64").glob("executorch-*-aarch64/executorch/share/cmake"))
    build = tmp_path / "build"
    result = subprocess.run(
        [
            "bash",
            "-c",
            'source scripts/device_build.sh && device_build "$0" "xnnpack;qnn" "$@"',
            str(build),
            "-DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake",
            f"-Dexecutorch_DIR={wheel}",
            f"-DCOMPOSITE_ARM64_SYSROOT={REPO / 'build-arm64' / 'sysroot'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "qnn_executorch_backend" in lines[0]
    assert not (build / "composite_runner").exists()
