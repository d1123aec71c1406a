"""A model as loaded from any source, with what its checkpoint says about tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from composite.model.llama import Transformer


@dataclass
class LoadedModel:
    model: Transformer
    kind: str  # "embedded" | "meta" | "hf" | "gguf"
    path: str | None  # the checkpoint path as given (None for the embedded default)
    tokenizer_path: Path | None  # a tokenizer found beside the checkpoint, if any
    bos_id: int | None = None  # from the checkpoint's own config, when it says
    eos_ids: tuple[int, ...] = ()
    chat_template: tuple[str, str] | None = None  # (Jinja, where from) when the checkpoint file holds one
