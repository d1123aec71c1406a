"""What the benchmark runs: a random-weight LLaMA of given dimensions written as a Meta checkpoint
(so our export and ExecuTorch's llama export read the very same file), a tokenizer, and a prompt."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from composite.model.llama import ModelArgs, Transformer
from composite.model.params import meta_ffn_hidden_dim
from composite.tokenizer import Tokenizer, train_sentencepiece

SEED = 110


@dataclass(frozen=True)
class Dims:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    prompt_tokens: int
    new_tokens: int
    multiple_of: int = 32

    def params_json(self) -> dict:
        return {
            "dim": self.dim,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_heads,
            "vocab_size": self.vocab_size,
            "multiple_of": self.multiple_of,
            "norm_eps": 1e-5,
            "rope_theta": 10000.0,
        }


DIMS = {
    # llama2.c's stories110M: the size the peer numbers were measured at.
    "stories110m": Dims(
        dim=768, n_layers=12, n_heads=12, vocab_size=32000, max_seq_len=512, prompt_tokens=308, new_tokens=128
    ),
    # Small enough for CI: keeps the benchmark script itself working.
    "tiny": Dims(dim=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=64, prompt_tokens=24, new_tokens=8),
}


def _synthetic_text(lines: int) -> str:
    """Random words: enough distinct pieces for a BPE vocabulary of tens of thousands."""
    rng = random.Random(SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(40000)]
    return "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines))


def write_workload(dims: Dims, folder: Path) -> dict[str, Path]:
    """Checkpoint, params.json, tokenizer.model and prompt.txt in `folder`; skipped when present."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in ("consolidated.00.pth", "params.json", "tokenizer.model", "prompt.txt")}
    if all(p.exists() for p in paths.values()):
        return paths
    text = _synthetic_text(30000)
    paths["tokenizer.model"].write_bytes(train_sentencepiece(text, dims.vocab_size))
    params = dims.params_json()
    hidden = meta_ffn_hidden_dim(dims.dim, dims.multiple_of, None)
    args = ModelArgs(
        dim=dims.dim,
        n_layers=dims.n_layers,
        n_heads=dims.n_heads,
        n_kv_heads=dims.n_heads,
        vocab_size=dims.vocab_size,
        hidden_dim=hidden,
        rope_theta=params["rope_theta"],
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        state = Transformer(args).state_dict()
    finally:
        torch.random.set_rng_state(generator_state)
    torch.save(state, paths["consolidated.00.pth"])
    paths["params.json"].write_text(json.dumps(params, indent=1) + "\n")
    # The prompt: text from the tokenizer's own training distribution, cut to exactly
    # prompt_tokens - 1 pieces so that with BOS both runners see prompt_tokens tokens.
    tokenizer = Tokenizer(paths["tokenizer.model"])
    ids = tokenizer.encode(text.split("\n", 200)[-1][:20000], bos=False)[: dims.prompt_tokens - 1]
    prompt = tokenizer.decode(ids)
    paths["prompt.txt"].write_text(prompt)
    return paths


def prompt_ids(paths: dict[str, Path]) -> list[int]:
    return Tokenizer(paths["tokenizer.model"]).encode(paths["prompt.txt"].read_text())
