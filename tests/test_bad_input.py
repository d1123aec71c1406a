"""Bad input: one clear line, exit code 2, no traceback, no artifact folder that looks complete."""

from __future__ import annotations

import json

import pytest

from conftest import LLAMA3_PARAMS, assert_clean_failure, run_cli, write_meta_checkpoint


def export(tmp_path, *args):
    out = tmp_path / "out"
    return run_cli("composite.export", "--output", str(out), "--max-seq-len", "32", "--prefill-len", "4", *args), out


def test_unknown_backend(tmp_path):
    result, out = export(tmp_path, "--shards", "2", "--placement", "xnnpack,xnnpak")
    assert_clean_failure(result, "unknown backend 'xnnpak'", "did you mean 'xnnpack'", output=out)


@pytest.mark.parametrize("n", ["0", "9"])
def test_shard_count_out_of_range(tmp_path, n):
    result, out = export(tmp_path, "--shards", n)
    assert_clean_failure(result, "shards", output=out)


def test_missing_checkpoint(tmp_path):
    result, out = export(tmp_path, "--checkpoint", str(tmp_path / "nope.pth"))
    assert_clean_failure(result, "does not exist", output=out)


def test_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "consolidated.00.pth"
    bad.write_bytes(b"this is not a checkpoint" * 10)
    (tmp_path / "params.json").write_text(json.dumps(LLAMA3_PARAMS))
    result, out = export(tmp_path, "--checkpoint", str(bad))
    assert_clean_failure(result, "corrupt", output=out)


def test_truncated_checkpoint(tmp_path):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", LLAMA3_PARAMS, seed=1)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    result, out = export(tmp_path, "--checkpoint", str(ckpt))
    assert_clean_failure(result, "corrupt", output=out)


@pytest.mark.parametrize("override, phrase", [({"dim": 96}, "shape"), ({"n_layers": 6}, "layers.5")])
def test_params_do_not_match_weights(tmp_path, override, phrase):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", LLAMA3_PARAMS, seed=1)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**LLAMA3_PARAMS, **override}))
    result, out = export(tmp_path, "--checkpoint", str(ckpt), "--params", str(wrong))
    assert_clean_failure(result, phrase, output=out)


def test_malformed_yaml(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("shards: [1, 2\nplacement: xnnpack\n")
    result, out = export(tmp_path, "--config", str(config))
    assert_clean_failure(result, "not valid YAML", "line", output=out)


def test_unknown_yaml_key(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("shards: 2\nplacment: xnnpack\n")
    result, out = export(tmp_path, "--config", str(config))
    assert_clean_failure(result, "unknown key 'placment'", "did you mean 'placement'", output=out)


def test_placement_for_missing_shard(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("shards: 2\nplacement: {default: xnnpack, 5: portable}\n")
    result, out = export(tmp_path, "--config", str(config))
    assert_clean_failure(result, "shard 5", output=out)


def test_unknown_xnnpack_head_quantize_in_yaml(tmp_path):
    config = tmp_path / "head.yaml"
    config.write_text("shards: 2\nxnnpack: {quantize: 8da4w, head_quantize: 4bit}\n")
    result, out = export(tmp_path, "--config", str(config))
    assert_clean_failure(result, "head_quantize must be one of 8da8w, same, none, got '4bit'", output=out)


def test_tokenizer_larger_than_vocabulary(tmp_path, default_tokenizer):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", LLAMA3_PARAMS, seed=1)  # vocabulary 300
    result, out = export(tmp_path, "--checkpoint", str(ckpt), "--tokenizer", str(default_tokenizer))
    assert_clean_failure(result, "512 tokens", "300", output=out)


def test_failed_export_keeps_previous_artifacts(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    result = run_cli("composite.export", "--output", str(out), "--shards", "99")
    assert result.returncode == 2
    assert (out / "manifest.json").read_text() == "{}"


def test_runner_errors(tmp_path, default_exports):
    folder = default_exports[3]
    result = run_cli("composite.run", "--artifacts", str(tmp_path / "missing"), "--prompt", "hi")
    assert_clean_failure(result, "does not exist")
    result = run_cli("composite.run", "--artifacts", str(folder), "--prompt", "")
    assert_clean_failure(result, "empty")
    result = run_cli("composite.run", "--artifacts", str(folder), "--prompt", "word " * 200)
    assert_clean_failure(result, "max_seq_len")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = broken / "shard_01.pte"
    shard.write_bytes(shard.read_bytes()[:1000])
    result = run_cli("composite.run", "--artifacts", str(broken), "--prompt", "hi")
    assert_clean_failure(result, "shard 1", "truncated")
    (broken / "manifest.json").write_text("{not json")
    result = run_cli("composite.run", "--artifacts", str(broken), "--prompt", "hi")
    assert_clean_failure(result, "malformed JSON")


def test_export_summary_and_manifest(default_exports):
    manifest = json.loads((default_exports[6] / "manifest.json").read_text())
    assert manifest["methods"] == {"decode": 1, "prefill": 12, "verify": 8}
    assert manifest["tokenizer"]["type"] == "sentencepiece" and manifest["bos_id"] == 1 and manifest["eos_ids"] == [2]
    first = manifest["shards"][0]["io"]["decode"]
    assert [t["name"] for t in first["inputs"]] == ["tokens", "input_pos", "mask", "k_cache.0", "v_cache.0"]
    assert first["inputs"][3]["shape"] == manifest["kv_cache"]["k_shape"]
    assert manifest["shards"][-1]["io"]["prefill"]["outputs"][0]["name"] == "logits"
    for shard in manifest["shards"]:
        assert shard["delegates"]["decode"]["XnnpackBackend"] >= 1


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KB tmpfs: too small for any shard. Needs root (CI runs as root)."""
    import subprocess

    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_out_of_disk_space_keeps_the_previous_export(small_disk, small_checkpoint):
    previous = small_disk / "out"
    previous.mkdir()
    manifest = json.dumps({"format": "composite-manifest", "note": "an earlier export"})
    (previous / "manifest.json").write_text(manifest)
    # the shard test_first_hour's stale-folder export lowers (0.8 MB): from the run's shard cache
    args = ["--checkpoint", str(small_checkpoint), "--max-seq-len", "32", "--prefill-len", "4"]
    result = run_cli("composite.export", *args, "--output", str(previous))
    assert_clean_failure(result, "out of disk space")
    assert sorted(p.name for p in small_disk.iterdir()) == ["out"]  # no staging folder left behind
    assert [p.name for p in previous.iterdir()] == ["manifest.json"]
    assert (previous / "manifest.json").read_text() == manifest
