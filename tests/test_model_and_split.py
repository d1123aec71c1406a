"""Unit tests of the model pieces and the splitter."""

from __future__ import annotations

import pytest
import torch

from composite.errors import UserError
from composite.model.default import DEFAULT_ARGS, default_model
from composite.model.llama import ModelArgs, apply_rope, rope_cos_sin
from composite.model.weights import meta_to_rotate_half
from composite.split.plan import plan_shards, unit_bytes


def meta_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's reference rotary embedding: interleaved pairs rotated as complex numbers."""
    hd = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.polar(torch.ones(len(positions), hd // 2), positions.float()[:, None] * freqs)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * angles).flatten(-2)


def test_meta_permutation_preserves_attention_scores():
    torch.manual_seed(0)
    heads, hd, dim, t = 2, 8, 16, 5
    wq, wk, x = torch.randn(heads * hd, dim), torch.randn(heads * hd, dim), torch.randn(t, dim)
    positions = torch.arange(t)

    def scores(q, k):
        return torch.einsum("thd,shd->hts", q, k)

    meta_q = meta_rope((x @ wq.T).view(t, heads, hd).transpose(0, 1), positions, 10000.0).transpose(0, 1)
    meta_k = meta_rope((x @ wk.T).view(t, heads, hd).transpose(0, 1), positions, 10000.0).transpose(0, 1)
    cos, sin = rope_cos_sin(1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd)), positions)
    ours_q = apply_rope((x @ meta_to_rotate_half(wq, heads).T).view(t, heads, hd).transpose(0, 1), cos, sin).transpose(
        0, 1
    )
    ours_k = apply_rope((x @ meta_to_rotate_half(wk, heads).T).view(t, heads, hd).transpose(0, 1), cos, sin).transpose(
        0, 1
    )
    assert torch.allclose(scores(meta_q, meta_k), scores(ours_q, ours_k), atol=1e-4)


def test_static_cache_step_equals_full_attention():
    """Cached attention (cache as input, new entries out) reproduces plain causal attention."""
    model = default_model()
    tokens = torch.randint(0, DEFAULT_ARGS.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    full = model.forward_full(tokens)
    s = 16
    k = [torch.zeros(DEFAULT_ARGS.n_kv_heads, DEFAULT_ARGS.head_dim, s) for _ in model.layers]
    v = [torch.zeros(DEFAULT_ARGS.n_kv_heads, s, DEFAULT_ARGS.head_dim) for _ in model.layers]
    with torch.no_grad():
        for pos in range(tokens.shape[1]):
            mask = torch.full((1, s + 1), -30000.0)
            mask[0, :pos] = 0
            mask[0, s] = 0
            cos, sin = rope_cos_sin(model.inv_freq, torch.tensor([pos]))
            h = model.tok_embeddings(tokens[:, pos : pos + 1])
            for i, layer in enumerate(model.layers):
                h, k_new, v_new = layer(h, cos, sin, mask, k[i], v[i])
                k[i][..., pos] = k_new[..., 0]
                v[i][:, pos] = v_new[:, 0]
            logits = model.output(model.norm(h))[0, 0]
            assert torch.allclose(logits, full[0, pos], atol=1e-5)


def test_default_weights_are_deterministic():
    a, b = default_model(), default_model()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_balanced_split_puts_embedding_first_and_head_last():
    args = ModelArgs(dim=64, n_layers=7, n_heads=4, n_kv_heads=2, vocab_size=5000, hidden_dim=128)
    for n in range(1, args.n_layers + 3):
        specs = plan_shards(args, n)
        assert len(specs) == n and specs[0].has_embedding and specs[-1].has_head
        assert [layer for s in specs for layer in s.layers] == list(range(args.n_layers))
        assert all(len(s.layers) or s.has_embedding or s.has_head for s in specs)
    # With a heavy vocabulary, the embedding and the head each end up alone when shards allow.
    four = plan_shards(args, 4)
    sizes = unit_bytes(args)
    heaviest = max(
        sum(sizes[1 + s.layer_start : 1 + s.layer_end]) + sizes[0] * s.has_embedding + sizes[-1] * s.has_head
        for s in four
    )
    assert heaviest == sizes[-1]


def test_explicit_layers_per_shard():
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=100, hidden_dim=128)
    specs = plan_shards(args, 3, [0, 3, 1])
    assert [list(s.layers) for s in specs] == [[], [0, 1, 2], [3]]
    with pytest.raises(UserError, match="sum to"):
        plan_shards(args, 3, [1, 1, 1])
    with pytest.raises(UserError, match="middle shard"):
        plan_shards(args, 3, [2, 0, 2])


@pytest.mark.parametrize("n", [0, 7])
def test_shard_count_out_of_range(n):
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=100, hidden_dim=128)
    with pytest.raises(UserError, match="out of range"):
        plan_shards(args, n)


def test_sampler_greedy_and_seeded():
    from composite.runtime.sampler import Sampler

    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler()(logits) == 1
    draws = [Sampler(temperature=1.0, top_p=0.9, seed=5)(logits) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    sampler = Sampler(temperature=1.0, top_p=0.5, seed=1)
    assert {sampler(logits) for _ in range(50)} == {1}  # top-p 0.5 keeps only the best token here


def test_shipped_configs_are_valid():
    from pathlib import Path

    from composite.config import build_config

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        config = build_config(str(path), {})
        assert len(config.placements()) == config.shards


def test_meta_llama3_2_params_export_with_rope_factor_32(workdir):
    """Meta's Llama 3.2 params.json (GQA, use_scaled_rope, vocab 128256) says no rope factor, and
    its checkpoint has no output.weight: the HF config of the same model says factor 32."""
    import json

    from conftest import export, write_meta_checkpoint

    params = {
        "dim": 32,
        "n_layers": 1,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 128256,
        "multiple_of": 32,
        "ffn_dim_multiplier": 1.5,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    }
    checkpoint = write_meta_checkpoint(workdir / "llama3_2_ckpt", params, seed=3)
    folder = export(workdir / "llama3_2", shards=1, checkpoint=str(checkpoint), max_seq_len=16, prefill_len=4)
    model = json.loads((folder / "manifest.json").read_text())["model"]
    assert model["tie_embeddings"] and model["n_kv_heads"] == 2
    assert model["rope_scaling"]["type"] == "llama3" and model["rope_scaling"]["factor"] == 32.0
