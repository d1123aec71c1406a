"""manifest.json written: each shard's entry, the whole document and its file, as manifest.py
describes them (the schema, and the checks both runners make when they read it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from composite.manifest import (
    FILENAME,
    FORMAT,
    MASK_HIDDEN,
    VERSION,
    dtype_name,
)
from composite.manifest_files import sha256_file


def tensor_entries(specs, native: dict | None = None) -> list[dict]:
    """native: name -> (dtype name, {scale, zero_point} or None) of tensors in a QNN shard's own dtype."""
    entries = []
    for s in specs:
        entry = {"name": s.name, "shape": list(s.shape), "dtype": dtype_name(s.dtype)}
        if native and s.name in native:
            entry["dtype"], quant = native[s.name]
            if quant is not None:
                entry["quant"] = quant
        entries.append(entry)
    return entries


def _standard_json(value):
    """JSON has no Infinity or NaN (the C++ reader rejects them): an exact SQNR, the one
    non-finite number an export measures, is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _standard_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_standard_json(v) for v in value]
    return value


def shard_entry(path: Path, spec, placement, lowered, io: dict, seconds: float) -> dict:
    """The manifest's record of one written shard file. spec: split.plan.ShardSpec; placement:
    config.Placement; lowered: lowering.program.LoweredProgram; io: method -> inputs/outputs."""
    entry = {
        "index": spec.index,
        "file": path.name,
        "sha256": sha256_file(path),
        "size": path.stat().st_size,
        "layers": [spec.layer_start, spec.layer_end],
        "has_embedding": spec.has_embedding,
        "has_head": spec.has_head,
        "placement": {"backend": placement.backend, "options": placement.options},
        "backends": lowered.backends,
        "delegates": lowered.delegates,
        "cpu_ops": lowered.cpu_ops,
        "io": io,
        "export_seconds": round(seconds, 2),
        "notes": lowered.notes,
    }
    if placement.backend == "qnn":
        entry["weight_sharing"] = placement.options["weight_sharing"]
    data = path.with_suffix(".ptd")
    if data.is_file():  # its own weights kept outside the .pte, until merge_data_files
        entry["data"] = file_entry(data)
    return entry


def file_entry(path: Path) -> dict:
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}


def document(
    *,
    export_id: str,
    model: dict,
    source: dict,
    max_seq_len: int,
    methods: dict[str, int],
    cache_shapes: tuple,
    rope_inv_freq: list[float],
    tokenizer: dict | None,
    bos_id: int | None,
    eos_ids: list[int],
    chat: dict | None,
    shards: list[dict],
    qnn: dict | None,
    versions: dict,
) -> dict:
    """The whole manifest, as the schema above describes it."""
    k_shape, v_shape = cache_shapes
    return {
        "format": FORMAT,
        "version": VERSION,
        "export_id": export_id,
        "model": model,
        "source": source,
        "max_seq_len": max_seq_len,
        "methods": dict(methods),
        "kv_cache": {
            "dtype": "float32",
            "k_shape": list(k_shape),
            "v_shape": list(v_shape),
            "k_new_shape": "[n_kv_heads, head_dim, T]",
            "v_new_shape": "[n_kv_heads, T, head_dim]",
        },
        "mask": {"shape": "[T, max_seq_len + T]", "visible": 0.0, "hidden": MASK_HIDDEN},
        "rope": {"convention": "rotate-half", "inv_freq": rope_inv_freq},
        "tokenizer": tokenizer,
        "bos_id": bos_id,
        "eos_ids": eos_ids,
        "chat": chat,
        "shards": shards,
        "qnn": qnn,
        "versions": versions,
    }


def write(folder: Path, manifest: dict) -> None:
    text = json.dumps(_standard_json(manifest), indent=1, allow_nan=False)
    (folder / FILENAME).write_text(text + "\n", encoding="utf-8")


def versions() -> dict:
    """The versions an export is made with (recorded in the manifest, and part of the cache keys)."""
    import executorch.version
    import torch
    import torchao

    import composite

    return {
        "composite": composite.__version__,
        "torch": torch.__version__,
        "executorch": executorch.version.__version__,
        "torchao": torchao.__version__,
    }
