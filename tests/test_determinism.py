"""Same inputs, same outputs: an export repeated gives byte-identical XNNPACK shards, and a seeded
sampling run repeated gives the same tokens. (QNN shards are not byte-identical between exports:
the QNN compiler's context binaries differ run to run; README, Known limits.)"""

from __future__ import annotations

import json

from composite import manifest as manifest_schema
from conftest import export, run_cli


def test_exporting_twice_gives_identical_xnnpack_shards(workdir, default_exports):
    again = export(workdir / "default_3_again", cached=False, shards=3)
    first, second = manifest_schema.read(default_exports[3]), manifest_schema.read(again)
    assert [s["sha256"] for s in first["shards"]] == [s["sha256"] for s in second["shards"]]
    assert first["tokenizer"]["sha256"] == second["tokenizer"]["sha256"]
    assert first["export_id"] != second["export_id"]


def test_seeded_sampling_repeats(default_exports):
    def sample(seed: str) -> list[int]:
        result = run_cli(
            "composite.run",
            "--artifacts",
            str(default_exports[3]),
            "--prompt",
            "Mia ran",
            "--max-new-tokens",
            "24",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--seed",
            seed,
            "--json",
            check=True,
        )
        return json.loads(result.stdout)["tokens"]

    first = sample("11")
    assert sample("11") == first
    assert sample("12") != first
