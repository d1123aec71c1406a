"""Past the context (composite/runtime/context_shift.py, runner_cpp/context_shift.cpp): a shifted
cache holds the keys the model computes at the tokens' new positions, both runners generate and
score alike across shifts, and bad settings get one line. runner_cpp/tests/test_kv_cache.cpp
checks the C++ shift against the same arithmetic."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from composite import manifest as manifest_schema
from composite.model.llama import ModelArgs, apply_rope, rope_cos_sin, rope_inv_freq
from composite.runtime.chain import ShardChain
from composite.runtime.context_shift import ContextShift, rotation_by
from composite.runtime.encoding import Encoding
from composite.runtime.kv_cache import KVCache
from conftest import DEBIAN_TEXT, MAX_SEQ_LEN, RUNNER, one_error_line, run_cli

TEXT = DEBIAN_TEXT
LLAMA3_ARGS = ModelArgs(
    dim=64,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=8,
    hidden_dim=8,
    rope_theta=500000.0,
    rope_scaling={
        "type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def roped(raw: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """raw keys [kv, hd, n] after RoPE at `positions` [n], as the model's apply_rope computes them."""
    cos, sin = rope_cos_sin(inv_freq, positions)
    return apply_rope(raw.transpose(1, 2), cos, sin).transpose(1, 2)


@pytest.mark.parametrize(
    "encoding, step",
    [
        (None, 2e-6),
        (Encoding(torch.float16), 2e-3),
        (Encoding(torch.uint16, 1e-4, 32768), 1e-4),
        (Encoding(torch.uint8, 2e-2, 128), 2e-2),
    ],
    ids=["float32", "float16", "uint16", "uint8"],
)
def test_a_shifted_cache_holds_the_keys_computed_at_the_new_positions(encoding, step):
    """Keys written at positions 0..used-1, shifted (keep 3, evict 7): each kept-and-moved key is
    the key computed fresh at its new position, within rounding (float) or 1.25 steps of a quantized
    encoding (the first encoding's half step, rotated: up to 0.71 of a step, then the second's half
    step); values move bit for bit; freed slots are empty."""
    kv, hd, slots, keep, evict, used = 2, 16, 40, 3, 7, 37
    inv_freq = rope_inv_freq(ModelArgs(**{**LLAMA3_ARGS.to_dict(), "head_dim": hd}))
    raw = 0.5 * torch.randn(kv, hd, used, generator=torch.Generator().manual_seed(0))  # within every range
    values = torch.randn(kv, used, hd, generator=torch.Generator().manual_seed(1))
    encode = (lambda x: x) if encoding is None else encoding.encode
    decode = (lambda x: x) if encoding is None else encoding.decode
    cache = KVCache(1, [kv, hd, slots], [kv, slots, hd], [(encoding, encoding)])
    cache.write(0, encode(roped(raw, torch.arange(used), inv_freq)), encode(values), 0, used)
    values_before = cache.v[0].clone()
    cos, sin = rotation_by(inv_freq, -evict)
    cache.shift(keep, evict, used, cos, sin)

    survivors = list(range(keep)) + list(range(keep + evict, used))
    fresh = roped(raw[:, :, survivors], torch.arange(len(survivors)), inv_freq)
    got = decode(cache.k[0][:, :, : len(survivors)])
    assert (got - fresh).abs().max() <= step * (1.25 if encoding is not None and encoding.quantized else 1.0)
    assert torch.equal(got[:, :, :keep], decode(encode(fresh[:, :, :keep])))  # the sinks stay as they were
    assert torch.equal(cache.v[0][:, keep : used - evict], values_before[:, keep + evict : used])
    empty = 0 if encoding is None else encoding.empty_value
    assert (cache.k[0][:, :, used - evict :] == empty).all() and (cache.v[0][:, used - evict :] == empty).all()


def test_an_export_shifted_holds_layer_zeros_keys_of_a_fresh_run(default_exports):
    """Layer 0's keys depend only on the token and its position: after a shift, the export's own
    cache equals a fresh run of the surviving tokens at their new positions (the export's RoPE is
    the one the manifest's frequencies describe)."""
    folder = default_exports[3]
    manifest = manifest_schema.read(folder)
    tokens = [(7 * i + 3) % manifest["model"]["vocab_size"] for i in range(MAX_SEQ_LEN)]
    shifted, fresh = ShardChain(folder), ShardChain(folder)
    shift = ContextShift(manifest, keep=4, evict=20)
    shifted.reset()
    for pos, token in enumerate(tokens):
        shifted.forward("decode", [token], pos)
    assert shift.room(shifted.cache, MAX_SEQ_LEN, 1) == MAX_SEQ_LEN - 20
    fresh.reset()
    for pos, token in enumerate(tokens[:4] + tokens[24:]):
        fresh.forward("decode", [token], pos)
    n = MAX_SEQ_LEN - 20
    assert torch.allclose(shifted.cache.k[0][:, :, :n], fresh.cache.k[0][:, :, :n], atol=2e-5)
    assert torch.equal(shifted.cache.v[0][:, :n], fresh.cache.v[0][:, :n])


def stats_of(runner: str, folder: Path, tmp_path: Path, *flags: str) -> dict:
    stats = tmp_path / f"{runner}.json"
    if runner == "cpp":
        result = subprocess.run([str(RUNNER), "--artifacts", str(folder), *flags, "--stats_json", str(stats)],
                                capture_output=True, text=True)  # fmt: skip
    else:
        result = run_cli("composite.run", "--artifacts", str(folder), *flags, "--stats-json", str(stats))
    assert result.returncode == 0, result.stderr
    return json.loads(stats.read_text())


@pytest.mark.usefixtures("needs_runner")
@pytest.mark.parametrize("flags", [(), ("--keep", "0", "--evict", "30")], ids=["defaults", "no-sinks"])
def test_both_runners_generate_alike_across_shifts(default_exports, tmp_path, flags):
    folder = default_exports[3]
    args = ["--prompt", "Once upon a time", "--max_new_tokens", "300", *flags]
    cpp, python = stats_of("cpp", folder, tmp_path, *args), stats_of("python", folder, tmp_path, *args)
    assert len(cpp["tokens"]) == 300 and cpp["stop_reason"] == "max_new_tokens"
    assert cpp["context_shifts"] >= 3 and cpp["context_shifts"] == python["context_shifts"]
    assert cpp["tokens"] == python["tokens"]
    walled = stats_of("cpp", folder, tmp_path, "--prompt", "Once upon a time", "--no_context_shift")
    assert walled["stop_reason"] == "max_seq_len" and walled["tokens"] == cpp["tokens"][: len(walled["tokens"])]


@pytest.mark.usefixtures("needs_runner", "needs_debian_text")
def test_a_streamed_text_scores_alike_in_both_runners_beside_the_float_model(default_exports, tmp_path):
    folder = default_exports[3]
    args = ["--limit-tokens", str(3 * MAX_SEQ_LEN), "--stream", "--json"]
    python = json.loads(run_cli("composite.eval", "--artifacts", str(folder), "--text", str(TEXT), *args,
                                "--reference", "eager", check=True).stdout)  # fmt: skip
    stats = tmp_path / "eval.json"
    cpp = subprocess.run([str(RUNNER), "--artifacts", str(folder), "--eval_text", str(TEXT), "--stream",
                          "--limit_tokens", str(3 * MAX_SEQ_LEN), "--stats_json", str(stats)],
                         capture_output=True, text=True)  # fmt: skip
    assert cpp.returncode == 0, cpp.stderr
    cpp = json.loads(stats.read_text())
    assert python["tokens"] == cpp["tokens"] == 3 * MAX_SEQ_LEN - 1
    assert python["context_shifts"] == cpp["context_shifts"] >= 2
    assert python["perplexity"] == pytest.approx(cpp["perplexity"], rel=1e-4)
    # The export's own float32 shards against the float model seeing the same window: close.
    assert python["ppl_ratio"] == pytest.approx(1.0, abs=0.05) and python["reference_full_perplexity"] > 0


@pytest.mark.usefixtures("needs_runner")
@pytest.mark.parametrize(
    "flags, phrase",
    [
        (("--keep", "96"), "--keep 96 leaves no room"),
        (("--evict", "0"), "--evict 0 is out of range"),
        (("--evict", "93"), "--evict 93 is out of range"),
        (("--keep", "2", "--no-context-shift"), "--keep and --evict shape the context shift"),
        (("--prompt-ids", ",".join(["5"] * 92)), "more than the context holds"),
    ],
)
def test_context_shift_settings_out_of_range_get_one_line_in_both_runners(default_exports, flags, phrase):
    folder = str(default_exports[3])
    prompt = [] if "--prompt-ids" in flags else ["--prompt", "hi"]
    python = run_cli("composite.run", "--artifacts", folder, *prompt, *flags)
    # composite_runner takes the same flags spelled with hyphens.
    cpp = subprocess.run([str(RUNNER), "--artifacts", folder, *prompt, *flags], capture_output=True, text=True)
    for result in (python, cpp):
        assert phrase in one_error_line(result)


@pytest.mark.usefixtures("needs_runner")
def test_an_export_without_rope_frequencies_is_refused_past_nothing_but_the_shift(default_exports, tmp_path):
    """An export from before context shift: one line naming the cure; --no-context-shift runs it."""
    folder = tmp_path / "old"
    folder.mkdir()
    for item in default_exports[3].iterdir():
        (folder / item.name).symlink_to(item)
    manifest = json.loads((default_exports[3] / "manifest.json").read_text())
    del manifest["rope"]
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for command in (
        [str(RUNNER), "--artifacts", str(folder), "--prompt", "hi"],
        ["python", "-m", "composite.run", "--artifacts", str(folder), "--prompt", "hi"],
    ):
        result = subprocess.run(command, capture_output=True, text=True, cwd=RUNNER.parent.parent)
        assert "predates context shift" in one_error_line(result)
        walled = subprocess.run(
            [*command, "--no_context_shift"], capture_output=True, text=True, cwd=RUNNER.parent.parent
        )
        assert walled.returncode == 0, walled.stderr
