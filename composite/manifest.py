"""manifest.json: the only contract between the exporter and the runners (Python and C++).

Schema, version 1 (every key is required unless marked optional):
{
  "format": "composite-manifest", "version": 1,
  "export_id": str,                       # random per export; every shard file carries no id, so
                                          # runners match files by sha256/size against this manifest
  "model": {dim, n_layers, n_heads, n_kv_heads, vocab_size, hidden_dim, head_dim, norm_eps,
            rope_theta, rope_scaling, tie_embeddings},
  "source": {"kind": "embedded" | "meta" | "hf", "path": str | null},
  "max_seq_len": int,                     # cache slots; positions 0 .. max_seq_len-1
  "methods": {"decode": 1, "prefill": int},   # method name -> tokens per call
  "kv_cache": {
     "dtype": "float32",
     "k_shape": [n_kv_heads, head_dim, max_seq_len],   # sequence last
     "v_shape": [n_kv_heads, max_seq_len, head_dim],
     "k_new_shape": "[n_kv_heads, head_dim, T]", "v_new_shape": "[n_kv_heads, T, head_dim]"
  },
  "mask": {"shape": "[T, max_seq_len + T]", "visible": 0.0, "hidden": float},
          # additive; columns 0..max_seq_len-1 are cache slots, the last T the call's own tokens
  "tokenizer": {"file": str, "type": "sentencepiece"|"tiktoken"|"hf_json", "sha256": str} | null,
  "bos_id": int | null, "eos_ids": [int],
  "shards": [{
     "index": int, "file": str, "sha256": str, "size": int,
     "layers": [first, end),              # decoder layers, end exclusive
     "has_embedding": bool, "has_head": bool,
     "placement": {"backend": str, "options": {...}},
     "delegates": {method: {backend id: count}},     # read from the lowered program
     "cpu_ops": {method: [operator names]},          # run by ExecuTorch's CPU kernels
     "io": {method: {"inputs": [{"name","shape","dtype"}], "outputs": [...]}},
     "sqnr_db": {method: {output name: float | null}}   # optional, QNN shards: against the float
                                          # shard on held-out input; null = exact (no error)
  }],
  "versions": {"composite", "torch", "executorch", "torchao"}
}
Input names: "tokens" [1,T] int64 | "hidden" [1,T,dim]; then, for shards with layers, "input_pos"
[T] int64, "mask", and "k_cache.L", "v_cache.L" per layer L; the last shard's multi-token methods
end with "logits_index" [1] int64 (the row of the last valid token). Outputs: "hidden" [1,T,dim] |
"logits" [1,1,vocab] (the last token's only), then "k_new.L", "v_new.L" per layer.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from composite.errors import UserError

FORMAT = "composite-manifest"
VERSION = 1
FILENAME = "manifest.json"
MASK_HIDDEN = -30000.0  # finite so fp16 backends represent it; exp() of it is 0 in fp32
DECODE, PREFILL = "decode", "prefill"

# The dtypes the manifest names, as torch spells them and as ExecuTorch's ScalarType numbers them
# (runner_cpp/shard_chain.cpp maps the same names for the C++ runtime).
DTYPES = {
    "float32": ("torch.float32", 6),
    "float16": ("torch.float16", 5),
    "int64": ("torch.int64", 4),
    "int32": ("torch.int32", 3),
    "uint8": ("torch.uint8", 0),
    "uint16": ("torch.uint16", 27),
}
DTYPE_NAMES = {torch_name: name for name, (torch_name, _) in DTYPES.items()}
SCALAR_TYPE_NAMES = {code: name for name, (_, code) in DTYPES.items()}


def dtype_name(dtype) -> str:
    return DTYPE_NAMES[str(dtype)]


def tensor_entries(specs) -> list[dict]:
    return [{"name": s.name, "shape": list(s.shape), "dtype": dtype_name(s.dtype)} for s in specs]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    config.Placement; lowered: lowering.program.LoweredShard; io: method -> inputs/outputs."""
    return {
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


def document(
    *,
    export_id: str,
    model: dict,
    source: dict,
    max_seq_len: int,
    prefill_len: int,
    cache_shapes: tuple,
    tokenizer: dict | None,
    bos_id: int | None,
    eos_ids: list[int],
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
        "methods": {DECODE: 1, PREFILL: prefill_len},
        "kv_cache": {
            "dtype": "float32",
            "k_shape": list(k_shape),
            "v_shape": list(v_shape),
            "k_new_shape": "[n_kv_heads, head_dim, T]",
            "v_new_shape": "[n_kv_heads, T, head_dim]",
        },
        "mask": {"shape": "[T, max_seq_len + T]", "visible": 0.0, "hidden": MASK_HIDDEN},
        "tokenizer": tokenizer,
        "bos_id": bos_id,
        "eos_ids": eos_ids,
        "shards": shards,
        "qnn": qnn,
        "versions": versions,
    }


def check_against_program(program, shard: dict) -> None:
    """A lowered program's own method metadata must match what the manifest promises for it
    (program: an executorch.runtime Program)."""
    for method, io in shard["io"].items():
        meta = program.metadata(method)
        for kind, count, get in (
            ("inputs", meta.num_inputs(), meta.input_tensor_meta),
            ("outputs", meta.num_outputs(), meta.output_tensor_meta),
        ):
            expected = io[kind]
            if count != len(expected):
                raise RuntimeError(f"shard {shard['index']} {method}: {count} {kind}, manifest says {len(expected)}")
            for i, entry in enumerate(expected):
                info = get(i)
                dtype = SCALAR_TYPE_NAMES.get(int(info.dtype()), str(info.dtype()))
                if list(info.sizes()) != entry["shape"] or dtype != entry["dtype"]:
                    raise RuntimeError(
                        f"shard {shard['index']} {method} {kind[:-1]} {entry['name']}: program has "
                        f"{list(info.sizes())} {dtype}, manifest says {entry['shape']} {entry['dtype']}"
                    )


def write(folder: Path, manifest: dict) -> None:
    text = json.dumps(_standard_json(manifest), indent=1, allow_nan=False)
    (folder / FILENAME).write_text(text + "\n", encoding="utf-8")


def _fail(folder: Path, what: str):
    raise UserError(f"{folder / FILENAME}: {what}")


def read(folder: Path) -> dict:
    """Parse and check the structure runners rely on; file checks are `check_files`."""
    folder = Path(folder)
    path = folder / FILENAME
    if not folder.is_dir():
        raise UserError(f"artifacts folder {folder} does not exist")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: is {folder} an export folder?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is malformed JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        _fail(folder, f"not a composite manifest (format is not '{FORMAT}')")
    if manifest.get("version") != VERSION:
        _fail(folder, f"manifest version {manifest.get('version')!r} is not supported (this composite reads {VERSION})")
    for key in ("model", "max_seq_len", "methods", "kv_cache", "mask", "shards", "eos_ids", "export_id"):
        if key not in manifest:
            _fail(folder, f"missing '{key}'")
    shards = manifest["shards"]
    if not isinstance(shards, list) or not shards:
        _fail(folder, "'shards' must be a non-empty list")
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            _fail(folder, f"shard {i} is not an object")
        for key in ("index", "file", "sha256", "size", "layers", "io"):
            if key not in shard:
                _fail(folder, f"shard {i} has no '{key}'")
        if shard["index"] != i:
            _fail(folder, f"shard at position {i} says index {shard['index']}: shards are out of order")
        for method in manifest["methods"]:
            if method not in shard["io"]:
                _fail(folder, f"shard {i} has no I/O description for method '{method}'")
    return manifest


def check_files(folder: Path, manifest: dict, verify_sha256: bool = False) -> None:
    """Every shard file exists with the recorded size (and hash, when asked)."""
    folder = Path(folder)
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise UserError(f"shard {shard['index']}: {path} is missing")
        size = path.stat().st_size
        if size != shard["size"]:
            raise UserError(
                f"shard {shard['index']}: {path} is {size} bytes but the manifest says {shard['size']} "
                "(truncated, or from another export)"
            )
        if verify_sha256 and sha256_file(path) != shard["sha256"]:
            raise UserError(
                f"shard {shard['index']}: {path} does not match the manifest's sha256 (from another export?)"
            )
    tokenizer = manifest.get("tokenizer")
    if tokenizer and not (folder / tokenizer["file"]).is_file():
        raise UserError(f"tokenizer {folder / tokenizer['file']} named by the manifest is missing")
