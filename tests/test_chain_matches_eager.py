"""Chaining N shards gives the unsplit eager model's logits and tokens."""

from __future__ import annotations

import pytest
import torch

from composite.manifest import read
from composite.runtime.chain import ShardChain
from composite.runtime.generate import generate
from composite.runtime.reference import generate_reference, reference_model
from composite.runtime.sampler import Sampler
from conftest import LLAMA3_SHARD_COUNTS, PREFILL_LEN, SHARD_COUNTS

PROMPT_LEN, DECODE_STEPS = 32, 32


def prompt_ids(vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(3)
    return [1] + torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=generator).tolist()


def compare(folder):
    manifest = read(folder)
    prompt = prompt_ids(manifest["model"]["vocab_size"])
    chain = ShardChain(folder)
    ours = generate(chain, prompt, DECODE_STEPS + 1, Sampler(), keep_logits=True)
    ref = generate_reference(
        reference_model(manifest), prompt, DECODE_STEPS + 1, manifest["max_seq_len"], Sampler(), keep_logits=True
    )
    assert len(ref.logits) == PROMPT_LEN + DECODE_STEPS
    chunk_ends = {min(end, PROMPT_LEN) - 1 for end in range(PREFILL_LEN, PROMPT_LEN + PREFILL_LEN, PREFILL_LEN)}
    assert set(ours.logits) == chunk_ends | set(range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS))
    worst = max((logits - ref.logits[p]).abs().max().item() for p, logits in ours.logits.items())
    assert worst < 1e-4, f"max abs logit difference {worst}"
    assert ours.tokens == ref.tokens
    return manifest


@pytest.mark.parametrize("n", SHARD_COUNTS)
def test_embedded_default(default_exports, n):
    manifest = compare(default_exports[n])
    assert len(manifest["shards"]) == n
    assert all(s["backends"] == ["XnnpackBackend"] for s in manifest["shards"])


@pytest.mark.parametrize("n", LLAMA3_SHARD_COUNTS)
def test_llama3_style(llama3_exports, n):
    manifest = compare(llama3_exports[n])
    model = manifest["model"]
    assert model["tie_embeddings"] and model["n_kv_heads"] < model["n_heads"]
    assert model["rope_scaling"]["type"] == "llama3" and model["rope_theta"] == 500000.0


def test_layers_spread_over_shards(default_exports, llama3_exports):
    six = read(default_exports[6])["shards"]
    assert [s["layers"] for s in six] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]
    three = read(llama3_exports[3])["shards"]
    covered = [layer for s in three for layer in range(*s["layers"])]
    assert covered == list(range(5))
    assert three[0]["has_embedding"] and three[-1]["has_head"]
