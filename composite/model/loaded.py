"""A model as opened from any source: its hyper-parameters, its tensors (read when asked for), and
what its checkpoint says about tokens.

`model` builds the whole Transformer (every tensor read); an export asks for one part at a time
instead (`part`): a Transformer whose other parts stay on the meta device and take no memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from composite.model.llama import ModelArgs, Transformer, rope_inv_freq
from composite.model.weights import WeightSource

EMBEDDING, HEAD_NORM, HEAD = "tok_embeddings.weight", "norm.weight", "output.weight"


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `args` holds, by Meta's name (a tied model has no head of its own)."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        shapes.pop(HEAD)
    return shapes


def part_names(args: ModelArgs, embedding: bool, layers: range, head: bool) -> list[str]:
    """The checkpoint tensors one part of the model is made of (a tied head reads the embedding)."""
    names = []
    if embedding or (head and args.tie_embeddings):
        names.append(EMBEDDING)
    every = expected_shapes(args)
    for layer in layers:
        names += [name for name in every if name.startswith(f"layers.{layer}.")]
    if head:
        names.append(HEAD_NORM)
        if not args.tie_embeddings:
            names.append(HEAD)
    return names


def build_model(args: ModelArgs, tensors: dict[str, torch.Tensor], embedding: bool = True) -> Transformer:
    """A Transformer holding `tensors` (Meta names, float32, taken as they are, not copied); the
    parts not given stay on the meta device. A tied head gets the embedding's table; embedding:
    whether the model's own embedding is one of the parts (False: only the head reads the table)."""
    with torch.device("meta"):
        model = Transformer(args)
    tensors = dict(tensors)
    table = tensors.get(EMBEDDING)
    if not embedding:
        tensors.pop(EMBEDDING, None)
    if args.tie_embeddings and table is not None and HEAD_NORM in tensors:
        tensors[HEAD] = table
    model.load_state_dict(tensors, strict=False, assign=True)
    if args.tie_embeddings and embedding and HEAD in tensors:
        model.output.weight = model.tok_embeddings.weight  # one Parameter, as Transformer ties them
    model.inv_freq = rope_inv_freq(args)
    return model.eval()


def is_materialized(module: torch.nn.Module) -> bool:
    return not any(p.is_meta for p in module.parameters())


@dataclass
class LoadedModel:
    args: ModelArgs
    weights: WeightSource
    kind: str  # "embedded" | "meta" | "hf" | "gguf"
    path: str | None  # the checkpoint path as given (None for the embedded default)
    tokenizer_path: Path | None  # a tokenizer found beside the checkpoint, if any
    bos_id: int | None = None  # from the checkpoint's own config, when it says
    eos_ids: tuple[int, ...] = ()
    chat_template: tuple[str, str] | None = None  # (Jinja, where from) when the checkpoint file holds one
    built: Transformer | None = field(default=None, repr=False)

    @property
    def model(self) -> Transformer:
        """The whole model, every tensor read (once)."""
        if self.built is None:
            self.built = self.part(True, range(self.args.n_layers), True)
        return self.built

    def part(self, embedding: bool, layers: range, head: bool) -> Transformer:
        """A Transformer with only these parts read; the rest stays on the meta device."""
        tensors = self.weights.read(part_names(self.args, embedding, layers, head))
        return build_model(self.args, tensors, embedding)

    def part_digest(self, embedding: bool, layers: range, head: bool) -> dict[str, str]:
        """name -> sha256 of each checkpoint tensor the part is made of, as the file stores it."""
        return self.weights.digests(part_names(self.args, embedding, layers, head))
