"""A Hugging Face checkpoint written by transformers, exported through our CLI, gives transformers'
own logits and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MAX_SEQ_LEN, PREFILL_LEN, run_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def hf_model(workdir, default_tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    folder = workdir / "hf_llama"
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="session", params=["graph", "kernel"])
def hf_export(request, workdir, hf_model, default_tokenizer):
    """Exported with either attention of the XNNPACK shards (composite::attention for "kernel")."""
    _, folder = hf_model
    out = workdir / f"hf_export_{request.param}"
    run_cli(
        "composite.export",
        "--checkpoint",
        str(folder),
        "--tokenizer",
        str(default_tokenizer),
        "--shards",
        "2",
        "--max-seq-len",
        str(MAX_SEQ_LEN),
        "--prefill-len",
        str(PREFILL_LEN),
        "--attention",
        request.param,
        "--output",
        str(out),
        check=True,
    )
    return out


def test_greedy_tokens_and_logits_match_transformers(hf_model, hf_export):
    model, _ = hf_model
    prompt = [1, 17, 230, 45, 99, 301, 7, 12, 400, 5]
    result = run_cli(
        "composite.run",
        "--artifacts",
        str(hf_export),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-new-tokens",
        "24",
        "--json",
        check=True,
    )
    ours = json.loads(result.stdout)["tokens"]
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours == expected

    from composite.runtime.chain import ShardChain
    from composite.runtime.generate import generate
    from composite.runtime.sampler import Sampler

    generation = generate(ShardChain(hf_export), prompt, 24, Sampler(), keep_logits=True)
    with torch.no_grad():
        full = model(torch.tensor([prompt + generation.tokens[:-1]])).logits[0]
    worst = max((logits - full[p]).abs().max().item() for p, logits in generation.logits.items())
    assert worst < 1e-4


def test_transformers5_config_dialect(tmp_path):
    from composite.model.params import args_from_hf_config

    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = args_from_hf_config(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}, tmp_path
    )
    v5 = args_from_hf_config(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}, tmp_path
    )
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling["factor"] == 32.0
