"""A trained model's residual stream carries single values of ~25,000 (SmolLM2-135M: one channel,
from layer 11 on). fp16 shards, XNNPACK and QNN alike, must carry them through their norms and
attention without overflow: here the tiny default with such a value planted in the embedding of
its BOS token, so that every layer of every shard sees it."""

from __future__ import annotations

import json

import pytest
import torch

from composite.model.default import default_model
from composite.runtime.chain import ShardChain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from conftest import FP16_PLACEMENT, export, rotate_half_to_meta

MASSIVE = 25_000.0
PROMPT = [1, 17, 230, 45, 99, 301, 7, 12, 400, 5, 88, 120]  # BOS first
NEW_TOKENS = 12


def planted_model():
    model = default_model()
    with torch.no_grad():
        model.tok_embeddings.weight[1, 7] = MASSIVE
    return model


@pytest.fixture(scope="session")
def planted_checkpoint(workdir, default_tokenizer):
    model = planted_model()
    args = model.args
    folder = workdir / "massive"
    folder.mkdir()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for key in state:
        if key.endswith("attention.wq.weight"):
            state[key] = rotate_half_to_meta(state[key], args.n_heads)
        elif key.endswith("attention.wk.weight"):
            state[key] = rotate_half_to_meta(state[key], args.n_kv_heads)
    torch.save(state, folder / "consolidated.00.pth")
    params = {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "hidden_dim": args.hidden_dim,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
    }
    (folder / "params.json").write_text(json.dumps(params))
    (folder / "tokenizer.model").write_bytes(default_tokenizer.read_bytes())
    return folder / "consolidated.00.pth"


def check_close_to_float32(folder) -> None:
    """Every logit finite, within a few percent of the float32 model's, and the same greedy tokens."""
    generation = generate(ShardChain(folder), PROMPT, NEW_TOKENS, Sampler(), keep_logits=True)
    with torch.no_grad():
        full = planted_model().forward_full(torch.tensor([PROMPT + generation.tokens[:-1]]))[0]
    for position, logits in generation.logits.items():
        assert torch.isfinite(logits).all(), f"position {position}"
        scale = full[position].abs().max().item()
        assert (logits - full[position]).abs().max().item() < 0.03 * scale, f"position {position}"
    expected = full.argmax(-1)[len(PROMPT) - 1 :].tolist()
    assert generation.tokens == expected


def test_the_plant_really_overflows_a_float16_square():
    hidden = planted_model().tok_embeddings.weight[1]
    assert torch.isinf((hidden.half() / hidden.numel() ** 0.5).pow(2)).any()


def test_xnnpack_fp16_shards_stay_finite_and_close_to_float32(workdir, planted_checkpoint):
    folder = export(
        workdir / "massive_xnnpack_fp16", shards=3, checkpoint=str(planted_checkpoint), xnnpack={"dtype": "fp16"}
    )
    check_close_to_float32(folder)


def test_qnn_fp16_shards_stay_finite_and_close_to_float32(qnn_ready, workdir, planted_checkpoint):
    folder = export(
        workdir / "massive_qnn_fp16", shards=6, placement=FP16_PLACEMENT, checkpoint=str(planted_checkpoint)
    )
    check_close_to_float32(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for shard in manifest["shards"][1:5]:
        # Measured on text that starts with BOS, as the runners' prompts do: the held-out input
        # holds the planted value.
        assert min(shard["sqnr_worst_token_db"].values()) > 40, shard["sqnr_worst_token_db"]
