"""The cache of lowered shards: a re-export lowers only what changed, with the bytes and tokens of
a cold export; keys change with weights, calibration and library versions; a corrupt entry is
dropped; --no-cache writes nothing; two exports at once leave a sound cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from composite import manifest as manifest_schema
from conftest import MAX_SEQ_LEN, PREFILL_LEN, REPO, assert_clean_failure, run_cli

PROMPT_IDS = "1,17,230,45,99,301,7,12,400,5"


def export_cli(output: Path, cache: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COMPOSITE_CACHE": str(cache)}
    args = ["--shards", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--prefill-len", str(PREFILL_LEN)]
    return run_cli("composite.export", *args, "--output", str(output), *flags, env=env, check=True)


def cache_column(stdout: str) -> list[str]:
    """The export summary's cache column, one value per shard."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("shard "))
    at = header.index("cache")
    rows = [line for line in lines[lines.index(header) + 1 :] if re.match(r"\d+  ", line)]
    return [row[at:].split()[0] for row in rows]


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("??/*") if p.is_dir())


def tokens(export: Path) -> list[int]:
    result = run_cli("composite.run", "--artifacts", str(export), "--prompt-ids", PROMPT_IDS, "--json", check=True)
    return json.loads(result.stdout)["tokens"]


def shard_hashes(export: Path) -> list[str]:
    return [s["sha256"] for s in manifest_schema.read(export)["shards"]]


@pytest.fixture(scope="session")
def cold(workdir):
    cache = workdir / "shard_cache"
    result = export_cli(workdir / "cache_cold", cache)
    return cache, workdir / "cache_cold", result.stdout


def test_a_cold_export_stores_every_shard(cold):
    cache, _, stdout = cold
    assert cache_column(stdout) == ["stored", "stored"]
    assert len(entries(cache)) == 2


def test_a_changed_placement_lowers_only_that_shard_with_a_cold_exports_bytes_and_tokens(cold, workdir):
    cache, cold_export, _ = cold
    changed = export_cli(workdir / "cache_changed", cache, "--placement", "xnnpack,portable")
    assert cache_column(changed.stdout) == ["hit", "stored"]
    assert "(1 of them from the cache)" in changed.stdout
    before = sorted(p.name for p in entries(cache))
    # The same export lowered from scratch, with --no-cache, which writes nothing to the cache.
    reference = export_cli(workdir / "cache_reference", cache, "--placement", "xnnpack,portable", "--no-cache")
    assert cache_column(reference.stdout) == ["off", "off"]
    assert sorted(p.name for p in entries(cache)) == before
    assert shard_hashes(workdir / "cache_changed") == shard_hashes(workdir / "cache_reference")
    assert shard_hashes(workdir / "cache_changed")[0] == shard_hashes(cold_export)[0]
    assert tokens(workdir / "cache_changed") == tokens(workdir / "cache_reference")


def test_a_corrupt_entry_is_dropped_and_lowered_again(cold, workdir):
    cache, cold_export, _ = cold
    head = shard_hashes(cold_export)[1]  # the cold export's last shard, not the portable one stored since
    victim = next(e for e in entries(cache) if json.loads((e / "entry.json").read_text())["sha256"] == head)
    data = (victim / "shard.pte").read_bytes()
    (victim / "shard.pte").write_bytes(data[: len(data) // 2])
    repaired = export_cli(workdir / "cache_repaired", cache)
    assert cache_column(repaired.stdout) == ["hit", "stored"]
    warnings = [line for line in repaired.stderr.splitlines() if line.startswith("warning: dropped a corrupt")]
    assert len(warnings) == 1, repaired.stderr
    assert shard_hashes(workdir / "cache_repaired") == shard_hashes(cold_export)


def test_two_exports_at_once_leave_a_sound_cache(workdir, small_checkpoint):
    """Both lower the same one-shard export and store it under one key at the same time."""
    cache = workdir / "shard_cache_race"
    env = {**os.environ, "COMPOSITE_CACHE": str(cache)}
    args = ["--checkpoint", str(small_checkpoint), "--shards", "1", "--max-seq-len", str(MAX_SEQ_LEN)]
    args += ["--prefill-len", str(PREFILL_LEN)]
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "composite.export", *args, "--output", str(workdir / f"race_{i}")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for run in runs:
        _, err = run.communicate()
        assert run.returncode == 0, err
    assert len(entries(cache)) == 1 and not list(cache.glob(".new-*"))
    assert shard_hashes(workdir / "race_0") == shard_hashes(workdir / "race_1")
    # The entry passes the checks a later export makes before it takes a shard from the cache.
    from composite.shard_cache import ShardCache

    (entry,) = entries(cache)
    taken = ShardCache(cache, 1 << 30).get(entry.name, workdir, "race_check.pte")
    assert taken is not None and taken["sha256"] == shard_hashes(workdir / "race_0")[0]


def keys_for(loaded, placements: list[str], calibration: dict | None = None) -> dict[int, str]:
    from composite.config import build_config
    from composite.lowering.jobs import shard_works
    from composite.shard_cache import export_keys
    from composite.split.plan import plan_shards

    values = {"shards": len(placements), "placement": placements, "max_seq_len": MAX_SEQ_LEN}
    values.update(prefill_len=PREFILL_LEN, qnn={"precision": "16a4w", "calibration": calibration or {}})
    config = build_config(None, values)
    specs = plan_shards(loaded.args, len(placements))
    return export_keys(shard_works(loaded, specs, config.placements(), config, None, None))


def test_keys_change_with_a_weight_and_with_library_versions(monkeypatch):
    import torch

    from composite import manifest_write
    from composite.model.default import load_default

    loaded = load_default()
    base = keys_for(loaded, ["xnnpack", "xnnpack", "xnnpack"])
    assert len(set(base.values())) == 3
    with torch.no_grad():  # the keys hash the checkpoint's stored tensors
        loaded.weights.tensors["layers.2.feed_forward.w2.weight"][0, 0] += 1e-3  # a layer of the middle shard
    changed = keys_for(loaded, ["xnnpack", "xnnpack", "xnnpack"])
    assert [base[i] == changed[i] for i in range(3)] == [True, False, True]
    real = manifest_write.versions()
    monkeypatch.setattr(manifest_write, "versions", lambda: {**real, "executorch": "0.0.0"})
    assert all(keys_for(loaded, ["xnnpack", "xnnpack", "xnnpack"])[i] != changed[i] for i in range(3))


def test_a_calibration_setting_changes_the_qnn_shards_key_only(qnn_ready):
    from composite.model.default import load_default

    loaded = load_default()
    placements = ["xnnpack", "qnn", "xnnpack"]
    base = keys_for(loaded, placements, calibration={"samples": 8})
    other = keys_for(loaded, placements, calibration={"samples": 9})
    assert [base[i] == other[i] for i in range(3)] == [True, False, True]


def test_a_qnn_shards_key_follows_the_float_model_up_to_it_only(qnn_ready):
    """Its calibration inputs come from the shards before it: a weight after it changes nothing."""
    import torch

    from composite.model.default import load_default

    loaded = load_default()
    placements = ["xnnpack", "qnn", "xnnpack"]
    base = keys_for(loaded, placements)
    with torch.no_grad():
        loaded.weights.tensors["layers.5.feed_forward.w2.weight"][0, 0] += 1e-3  # the last shard's
    after = keys_for(loaded, placements)
    assert [base[i] == after[i] for i in range(3)] == [True, True, False]
    with torch.no_grad():
        loaded.weights.tensors["tok_embeddings.weight"][0, 0] += 1e-3  # the first shard's
    before = keys_for(loaded, placements)
    assert [after[i] == before[i] for i in range(3)] == [False, False, True]


@pytest.mark.parametrize("limit", ["lots", "-5"])
def test_a_cache_size_limit_that_is_not_a_size_gets_one_line(tmp_path, limit):
    env = {**os.environ, "COMPOSITE_CACHE": str(tmp_path / "cache"), "COMPOSITE_CACHE_MAX_MB": limit}
    output = tmp_path / "out"
    result = run_cli("composite.export", "--shards", "2", "--output", str(output), env=env)
    assert_clean_failure(result, f"COMPOSITE_CACHE_MAX_MB must be a whole number of megabytes >= 0, got '{limit}'")
    assert not output.exists() and not (tmp_path / "cache").exists()


def qnn_works(loaded):
    from composite.config import build_config
    from composite.lowering.jobs import shard_works
    from composite.split.plan import plan_shards

    values = {"shards": 3, "placement": ["xnnpack", "qnn", "xnnpack"], "max_seq_len": MAX_SEQ_LEN}
    config = build_config(None, {**values, "prefill_len": PREFILL_LEN, "qnn": {"precision": "16a4w"}})
    return shard_works(loaded, plan_shards(loaded.args, 3), config.placements(), config, None, None)


def test_a_tensors_digest_is_of_its_bytes_as_the_file_stores_them(tmp_path):
    """The keys hash a tensor as stored (bf16 stays bf16), from its file's own bytes: one byte
    changed in the file changes its digest."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from composite.model.weights import SafetensorsWeights

    path, name = tmp_path / "model.safetensors", "tok_embeddings.weight"
    save_file({"model.embed_tokens.weight": torch.randn(8, 4).to(torch.bfloat16)}, str(path))
    weights = SafetensorsWeights({name: (path, "model.embed_tokens.weight")}, {name: (8, 4)}, str(path))
    raw = path.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:header])["model.embed_tokens.weight"]["data_offsets"]
    stored = raw[header + start : header + end]
    assert len(stored) == 8 * 4 * 2
    expected = hashlib.sha256(f"{name}|torch.bfloat16|[8, 4]|None|".encode() + stored).hexdigest()
    assert weights.digests([name]) == {name: expected}
    path.write_bytes(raw[: header + start] + bytes([raw[header + start] ^ 1]) + raw[header + start + 1 :])
    assert weights.digests([name])[name] != expected


def test_the_key_holds_every_field_of_a_shards_work():
    """A field of ShardWork that its key leaves out would give a stale cache hit: the wrong .pte."""
    import dataclasses

    from composite.lowering.work import NOT_IN_KEY, ShardWork
    from composite.model.default import load_default

    loaded = load_default()
    work = qnn_works(loaded)[1]
    assert work.calls is not None
    fields = {f.name for f in dataclasses.fields(ShardWork)}
    assert set(work.key_parts(loaded.weights.digests)) == fields - set(NOT_IN_KEY)


def test_each_field_of_a_shards_work_changes_its_key():
    import dataclasses

    from composite.config import Placement
    from composite.model.default import load_default
    from composite.model.weights import TensorWeights
    from composite.shard_cache import export_keys

    loaded = load_default()
    work = qnn_works(loaded)[1]
    changed_table = dict(loaded.weights.tensors)
    changed_table["tok_embeddings.weight"] = changed_table["tok_embeddings.weight"] + 1e-3  # before the shard
    changed_layer = dict(loaded.weights.tensors)
    name = f"layers.{work.spec.layer_start}.attention.wq.weight"
    changed_layer[name] = changed_layer[name] + 1e-3  # the shard's own
    others = {
        "spec": dataclasses.replace(work.spec, has_head=True),
        "placement": Placement("qnn", {**work.placement.options, "precision": "16a8w"}),
        "args": dataclasses.replace(work.args, norm_eps=work.args.norm_eps * 2),
        "weights": TensorWeights(changed_layer),
        "rotation": "hadamard",
        "max_seq_len": work.max_seq_len + 1,
        "prefill_len": work.prefill_len + 1,
        "verify_len": work.verify_len + 1,
        "embedding_quantize": (4, 32),
        "head_shard": work.head_shard + 1,
        "calls": work.calls[:-1],
        "shared_table": "symmetric",
        "stream": TensorWeights(changed_table),  # the float model before the shard decides it
        "next_stream": TensorWeights(changed_layer),  # ...and through it
    }
    # Every field is changed here, by construction: a new field fails this test until it is.
    from composite.lowering.work import NOT_IN_KEY, ShardWork

    assert set(others) == {f.name for f in dataclasses.fields(ShardWork)} - set(NOT_IN_KEY)
    base = export_keys([work])[1]
    for field, value in others.items():
        streams = field in ("stream", "next_stream")  # not fields one sets: the weights decide them
        changed = dataclasses.replace(work, **({"weights": value} if streams else {field: value}))
        assert export_keys([changed])[1] != base, field
    assert export_keys([dataclasses.replace(work, output="elsewhere.pte")])[1] == base
