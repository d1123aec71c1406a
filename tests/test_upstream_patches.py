"""The upstream code each lowering patch relies on is as it was when the patch was written
(composite/lowering/upstream_patches.py). A failure here is not a bug to silence: read the new
upstream code, check the patch against it, then record the shape the test prints."""

from __future__ import annotations

import inspect

import pytest

from composite.lowering import upstream_patches
from composite.lowering.upstream_patches import RELIED_ON, TARGETS, Target

CASES = [(patch, target) for patch, targets in {**TARGETS, **RELIED_ON}.items() for target in targets]


@pytest.mark.parametrize(("patch", "target"), CASES, ids=[f"{p}:{t.name}" for p, t in CASES])
def test_each_patch_meets_the_upstream_code_it_was_written_for(patch, target, request):
    if target.module.startswith("executorch.backends.qualcomm"):
        request.getfixturevalue("qnn_ready")  # QNN's Python modules load the host libraries
    shape = target.current_shape()
    assert shape == target.shape, (
        f"{target.module}.{target.name} is not what {patch} was written for ({target.version}): check the patch "
        f"against it, then record its shape {shape!r}"
    )


def test_every_patch_names_what_it_relies_on():
    patches = {
        name
        for name, value in vars(upstream_patches).items()
        if inspect.isfunction(value) and value.__module__ == upstream_patches.__name__
    }
    helpers = {"mapped_from_disk"}  # called by lean_preprocess, patches nothing itself
    assert patches - helpers == set(TARGETS)


def test_a_changed_function_has_another_shape():
    recorded = Target("python", "json", "dumps", Target("python", "json", "dumps", "").current_shape())
    assert recorded.current_shape() == recorded.shape
    assert Target("python", "json", "loads", recorded.shape).current_shape() != recorded.shape
