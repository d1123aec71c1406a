"""Both manifest readers give the same verdict on every shared case: the Python one here, the C++
one in runner_cpp/tests/test_manifest.cpp (SharedFixtures), against tests/manifests/expected.json."""

from __future__ import annotations

import json

import pytest

from composite.errors import UserError
from composite.manifest import parse
from conftest import REPO

FIXTURES = REPO / "tests" / "manifests"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def verdict(name: str) -> str | None:
    try:
        parse((FIXTURES / name).read_text(), "fixture")
    except UserError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_python_reader_gives_the_shared_verdict(name):
    assert verdict(name) == EXPECTED[name]


def test_every_fixture_has_a_verdict_and_both_kinds_exist():
    files = {p.name for p in FIXTURES.glob("*.json")} - {"expected.json"}
    assert files == set(EXPECTED)
    assert any(v is None for v in EXPECTED.values()) and sum(v is not None for v in EXPECTED.values()) >= 20
