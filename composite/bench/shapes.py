"""Llama-3.2-shaped Hugging Face checkpoints with seeded random weights, for measuring exports and
runners at the sizes the tool is for when no trained weights of those sizes are at hand.

A checkpoint is written a few layers per safetensors file (with model.safetensors.index.json), so
writing it holds one file's tensors at a time. Every tensor has its own seed (the checkpoint's
seed and its name), so a tensor is the same whichever file it lands in. The tokenizer is a Llama 3
style tiktoken file with 128,000 ranks (every byte, every pair of bytes, then triples of printable
characters: every rank can be reached by BPE merges), so both runners and the Llama 3 special tokens
(ids 128000 and up) see the vocabulary of the real model.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import torch

# Hugging Face config.json of the Llama 3.2 shapes (hyper-parameters as Meta publishes them).
LLAMA3_2_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
SHAPES = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64},
    "3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "intermediate_size": 8192,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA3_2_ROPE,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
TIKTOKEN_RANKS = 128000


def config_for(shape: str, **overrides) -> dict:
    return {**COMMON, **SHAPES[shape], **overrides}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape, embedding first, then layer by layer, then the final norm."""
    d, hidden, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * hd, d),
                p + "self_attn.k_proj.weight": (kv * hd, d),
                p + "self_attn.v_proj.weight": (kv * hd, d),
                p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "mlp.gate_proj.weight": (hidden, d),
                p + "mlp.up_proj.weight": (hidden, d),
                p + "mlp.down_proj.weight": (d, hidden),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
    shapes["model.norm.weight"] = (d,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Norm weights near 1; matrices with a Llama-like spread (std 0.02); bf16 as Meta ships them."""
    generator = torch.Generator().manual_seed(seed ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big"))
    if len(shape) == 1:
        values = 1.0 + 0.05 * torch.randn(shape, generator=generator)
    else:
        values = 0.02 * torch.randn(shape, generator=generator)
    return values.to(torch.bfloat16)


def write_checkpoint(folder: Path, config: dict, seed: int = 0, layers_per_file: int = 4) -> Path:
    """config.json, model-0000i-of-0000n.safetensors + index, tokenizer.model (tiktoken)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    groups: list[list[str]] = [["model.embed_tokens.weight"]]
    for first in range(0, config["num_hidden_layers"], layers_per_file):
        prefixes = tuple(
            f"model.layers.{i}." for i in range(first, min(first + layers_per_file, config["num_hidden_layers"]))
        )
        groups.append([name for name in shapes if name.startswith(prefixes)])
    groups[-1] += [name for name in ("model.norm.weight", "lm_head.weight") if name in shapes]
    weight_map = {}
    for number, names in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: random_tensor(name, shapes[name], seed) for name in names}, str(folder / file))
        weight_map.update({name: file for name in names})
    index = {"metadata": {"total_size": sum(2 * _count(s) for s in shapes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_tiktoken(folder / "tokenizer.model")
    return folder


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def tiktoken_ranks(count: int = TIKTOKEN_RANKS) -> list[bytes]:
    """Every byte, every pair of bytes, then triples of printable ASCII: `count` BPE ranks."""
    ranks = [bytes([b]) for b in range(256)]
    ranks += [bytes([a, b]) for a in range(256) for b in range(256)]
    printable = range(32, 127)
    for a in printable:
        for b in printable:
            for c in printable:
                if len(ranks) == count:
                    return ranks
                ranks.append(bytes([a, b, c]))
    return ranks[:count]


def write_tiktoken(path: Path) -> Path:
    path.write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tiktoken_ranks()))
    )
    return path
