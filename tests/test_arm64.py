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

from conftest import REPO, export

ARM_RUNNER = REPO / "build-arm64" / "composite_runner"
X86_RUNNER = REPO / "build" / "composite_runner"
QEMU = shutil.which("qemu-aarch64-static")
NEW_TOKENS = 32
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def arm64_ready():
    missing = [what for what, ok in (("scripts/build_arm64.sh has not built build-arm64/composite_runner", ARM_RUNNER.exists()),
                                     ("qemu-aarch64-static is not installed", QEMU is not None),
                                     ("build/composite_runner is not built", X86_RUNNER.exists())) if not ok]
    if missing:
        if os.environ.get("COMPOSITE_REQUIRE_ARM64") == "1":
            pytest.fail("; ".join(missing))
        pytest.skip("; ".join(missing))


def tokens(command: list[str], folder: Path, stats: Path) -> tuple[list[int], float]:
    result = subprocess.run([*command, "--artifacts", str(folder), "--prompt", PROMPT, "--max_new_tokens",
                             str(NEW_TOKENS), "--stats_json", str(stats)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    data = json.loads(stats.read_text())
    return data["tokens"], data["decode_tokens_per_s"]


@pytest.mark.parametrize("quantize", ["none", "8da4w"])
def test_arm64_runner_generates_the_x86_tokens(arm64_ready, workdir, default_exports, quantize, tmp_path):
    folder = default_exports[3] if quantize == "none" else export(
        workdir / "default_3_8da4w", shards=3, xnnpack={"quantize": "8da4w", "group_size": 32})
    # -L /: Debian's arm64 multiarch libraries are the guest's root (see scripts/build_arm64.sh).
    arm, arm_speed = tokens([QEMU, "-L", "/", str(ARM_RUNNER)], folder, tmp_path / "arm.json")
    x86, x86_speed = tokens([str(X86_RUNNER)], folder, tmp_path / "x86.json")
    print(f"{quantize}: decode {arm_speed:.1f} tok/s emulated aarch64, {x86_speed:.1f} tok/s x86")
    assert len(arm) == NEW_TOKENS
    assert arm == x86
