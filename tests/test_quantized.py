"""XNNPACK 8da4w shards: smaller, fully delegated, and close to fp32."""

from __future__ import annotations

import json

import torch

from composite.runtime.chain import ShardChain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from conftest import export


def test_8da4w_shards(workdir, default_exports):
    folder = export(workdir / "default_2_8da4w", shards=2, xnnpack={"quantize": "8da4w", "group_size": 32})
    manifest = json.loads((folder / "manifest.json").read_text())
    fp32 = json.loads((default_exports[2] / "manifest.json").read_text())
    for q, f in zip(manifest["shards"], fp32["shards"]):
        assert q["placement"]["options"]["quantize"] == "8da4w"
        assert q["size"] < 0.5 * f["size"]
        assert "XnnpackBackend" in q["backends"]
    prompt = list(range(1, 20))
    quantized = generate(ShardChain(folder), prompt, 8, Sampler(), keep_logits=True).logits
    reference = generate(ShardChain(default_exports[2]), prompt, 8, Sampler(), keep_logits=True).logits
    prompt_positions = [p for p in reference if p < len(prompt)]  # same prompt logits: same inputs
    cosines = [
        torch.nn.functional.cosine_similarity(quantized[p], reference[p], dim=0).item() for p in prompt_positions
    ]
    assert min(cosines) > 0.95, cosines
