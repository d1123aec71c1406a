"""XNNPACK 8da4w shards: smaller, fully delegated, and close to fp32; quantized embedding tables."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from composite import manifest as manifest_schema
from composite.config import build_config
from composite.errors import UserError
from composite.lowering.embedding import QuantizedEmbedding
from composite.model.default import load_default
from composite.runtime.chain import ShardChain
from composite.runtime.generate import generate
from composite.runtime.reference import generate_reference
from composite.runtime.sampler import Sampler
from conftest import (
    MAX_SEQ_LEN,
    PREFILL_LEN,
    assert_clean_failure,
    export,
    lower_here,
    run_cli,
    runner_built,
    runner_tokens,
)


def test_8da4w_shards(default_8da4w_export, default_exports):
    folder = default_8da4w_export
    manifest = json.loads((folder / "manifest.json").read_text())
    fp32 = json.loads((default_exports[3] / "manifest.json").read_text())
    for q, f in zip(manifest["shards"], fp32["shards"]):
        assert q["placement"]["options"]["quantize"] == "8da4w"
        assert q["size"] < 0.5 * f["size"]
        assert "XnnpackBackend" in q["backends"]
    prompt = list(range(1, 20))
    quantized = generate(ShardChain(folder), prompt, 8, Sampler(), keep_logits=True).logits
    reference = generate(ShardChain(default_exports[3]), prompt, 8, Sampler(), keep_logits=True).logits
    prompt_positions = [p for p in reference if p < len(prompt)]  # same prompt logits: same inputs
    cosines = [
        torch.nn.functional.cosine_similarity(quantized[p], reference[p], dim=0).item() for p in prompt_positions
    ]
    assert min(cosines) > 0.95, cosines


@pytest.mark.parametrize(("setting", "bits", "group"), [("4,32", 4, 32), ("8,0", 8, 0)])
def test_quantized_embedding_generates_what_its_table_gives_in_eager(workdir, default_exports, setting, bits, group):
    folder = export(workdir / f"default_3_embedding_{bits}", shards=3, embedding_quantize=setting)
    manifest = json.loads((folder / "manifest.json").read_text())
    fp32 = json.loads((default_exports[3] / "manifest.json").read_text())
    # only the embedding's shard differs: the others come from the run's shard cache
    assert [s["sha256"] for s in manifest["shards"][1:]] == [s["sha256"] for s in fp32["shards"][1:]]
    first = manifest["shards"][0]
    assert first["notes"][0].startswith(f"embedding {bits}-bit")
    assert any(op.startswith("quantized_decomposed::embedding") for op in first["cpu_ops"]["decode"])
    model = load_default().model
    table = model.tok_embeddings.weight.detach()
    quantized = QuantizedEmbedding(table, bits, group)
    # 4 bits + a float16 scale per 32 values, or 8 bits + one per row, instead of 32 bits.
    stored = quantized.stored_bytes()
    assert stored == table.numel() * bits // 8 + table.shape[0] * (table.shape[1] // (group or table.shape[1])) * 2
    assert fp32["shards"][0]["size"] - first["size"] >= table.numel() * 4 - stored - 4096
    # The same quantized model in eager PyTorch: the float model with the table the kernels read.
    model.tok_embeddings.weight = nn.Parameter(quantized.dequantized())  # the tied head keeps the float table
    prompt = list(range(1, 20))
    reference = generate_reference(model, prompt, 16, manifest["max_seq_len"], Sampler(), keep_logits=True)
    ours = generate(ShardChain(folder), prompt, 16, Sampler(), keep_logits=True)
    assert ours.tokens == reference.tokens
    assert max((ours.logits[p] - reference.logits[p]).abs().max().item() for p in ours.logits) < 1e-4
    if runner_built():
        assert runner_tokens(folder, prompt, 16) == reference.tokens


@pytest.mark.parametrize(
    ("setting", "phrase"),
    [("3,32", "BITS 4 or 8"), ("4,-1", "GROUP >= 0"), ("four", "BITS,GROUP"), ("4,32,1", "BITS,GROUP")],
)
def test_bad_embedding_quantize_settings_are_refused(setting, phrase):
    with pytest.raises(UserError, match=phrase):
        build_config(None, {"embedding_quantize": setting})


def test_8da4w_keeps_an_8_bit_head_and_unclipped_scales_by_default(default_8da4w_export):
    """The defaults against torchao's: 4-bit head and symmetric scales (head_quantize same,
    weight_mapping symmetric). The last shard, lowered with torchao's: its scales change its bytes,
    its head alone its size."""
    import hashlib

    ours = manifest_schema.read(default_8da4w_export)
    torchao = {"quantize": "8da4w", "group_size": 32, "head_quantize": "same", "weight_mapping": "symmetric"}
    values = {"shards": 3, "max_seq_len": MAX_SEQ_LEN, "prefill_len": PREFILL_LEN, "xnnpack": torchao}
    plain = lower_here(load_default(), build_config(None, values), 2)
    last = ours["shards"][-1]
    assert last["placement"]["options"]["head_quantize"] == "8da8w"
    assert last["sha256"] != hashlib.sha256(plain).hexdigest()
    head_weights = ours["model"]["vocab_size"] * ours["model"]["dim"]
    # int8 weights against int4 ones (two to a byte, plus a scale per 32), one copy in the shard.
    assert 0.3 * head_weights < last["size"] - len(plain) < 0.6 * head_weights


def test_embedding_quantize_needs_a_cpu_embedding_shard_and_a_fitting_group(tmp_path):
    with pytest.raises(UserError, match="QNN shard"):
        build_config(None, {"embedding_quantize": "4,32", "shards": 2, "placement": ["qnn", "xnnpack"]})
    out = tmp_path / "out"
    result = run_cli("composite.export", "--embedding-quantize", "4,48", "--output", str(out))
    assert_clean_failure(result, "group size 48 does not divide the model's dim 128", output=out)
