"""The embedded default: a tiny LLaMA with deterministic random weights and a SentencePiece
tokenizer trained from text shipped in this package, so everything runs offline."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch

from composite.model.llama import ModelArgs, Transformer
from composite.model.loaded import LoadedModel, expected_shapes
from composite.model.weights import TensorWeights
from composite.tokenizer import train_sentencepiece

DEFAULT_ARGS = ModelArgs(
    dim=128, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=512, hidden_dim=352, rope_theta=10000.0
)
WEIGHT_SEED = 20261129


def corpus_text() -> str:
    return resources.files("composite.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def default_model(args: ModelArgs = DEFAULT_ARGS) -> Transformer:
    """Same weights on every machine: a fixed seed, and initialisation on the CPU in float32."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(WEIGHT_SEED)
        model = Transformer(args)
        with torch.no_grad():
            # Unit-scale embeddings and slightly wide norms keep logits spread out, so greedy
            # decoding never hinges on near-ties.
            model.tok_embeddings.weight.normal_(0.0, 1.0)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.8, 1.2)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def load_default() -> LoadedModel:
    folder = Path(tempfile.mkdtemp(prefix="composite-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tokenizer = folder / "tokenizer.model"
    tokenizer.write_bytes(train_sentencepiece(corpus_text(), DEFAULT_ARGS.vocab_size))
    model = default_model()
    stored = expected_shapes(model.args)
    weights = TensorWeights({k: v for k, v in model.state_dict().items() if k in stored}, "the embedded default")
    return LoadedModel(model.args, weights, "embedded", None, tokenizer, built=model)
