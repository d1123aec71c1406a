"""manifest.json: the only contract between the exporter and the runners (Python and C++).

This module describes it (below) and reads it (`read`, `parse`); manifest_files.py checks the files
beside it; manifest_write.py writes it (`shard_entry`, `document`, `write`); runner_cpp/manifest.cpp
reads it too, with the same checks and messages (tests/manifests holds cases both must judge alike).

Schema, version 2. [R] = read and checked by both runners; the rest is written for people and
tools (the runners ignore it). Every key is written by every export unless marked optional.
{
  "format": "composite-manifest", "version": 2,                                   [R]
  "export_id": str,              # random per export; the .pte files carry no id, so   [R: present]
                                 # runners match files by size/sha256 against this manifest
  "model": {dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size,             [R: these six]
            hidden_dim, norm_eps, rope_theta, rope_scaling, tie_embeddings},
  "source": {"kind": "embedded" | "meta" | "hf" | "gguf", "path": str | null,
             "rotation": "none" | "hadamard" | "hadamard-ffn"},   # the shards hold the source's weights
                                 # with the residual stream rotated (and, hadamard-ffn, each
                                 # feed-forward's hidden activation; composite/model/rotation.py);
                                 # absent in older exports: none
  "max_seq_len": int,            # cache slots; positions 0 .. max_seq_len-1          [R]
  "methods": {"decode": 1, "prefill": int, "verify": int},   # name -> tokens per call [R]
                                 # verify (optional): guesses checked in one call (runtime/speculate.py)
  "kv_cache": {                                                                     [R: dtype, shapes]
     "dtype": "float32",         # of the float layers; a quantized QNN shard's layers keep their
                                 # cache in the dtype and quantization of its k_cache/v_cache inputs
     "k_shape": [n_kv_heads, head_dim, max_seq_len],   # sequence last
     "v_shape": [n_kv_heads, max_seq_len, head_dim],
     "k_new_shape": "[n_kv_heads, head_dim, T]", "v_new_shape": "[n_kv_heads, T, head_dim]"
  },
  "mask": {"shape": "[T, max_seq_len + T]", "visible": 0.0, "hidden": float},     [R: hidden]
          # additive; columns 0..max_seq_len-1 are cache slots, the last T the call's own tokens
  "rope": {"convention": "rotate-half", "inv_freq": [head_dim / 2 floats]},     [R: optional]
          # the keys' rotary frequencies (scaling applied): a context shift re-rotates cached
          # keys with them (composite/runtime/context_shift.py); absent in older exports
  "tokenizer": {"file": str, "type": "sentencepiece"|"tiktoken"|"hf_json", "sha256": str} | null,
                                                                                  [R: file, type]
  "bos_id": int | null, "eos_ids": [int],                                          [R]
                                 # eos_ids: every id that ends generation (the tokenizer's eos,
                                 # end of turn, generation_config.json's eos_token_id list)
  "chat": {                      # the model's chat template as text around each   [R: optional]
                                 # message (composite/chat_template.py renders and checks it):
     "source": str,              # where the template came from
     "system_prefix": str | null, "system_suffix": str | null,   # around a system message;
                                 # null: the template has no system role
     "first_user_prefix": str,   # before the first user message when there is no system message
     "user_prefix": str,         # after the end of turn that closes an answer, before the next
                                 # user message
     "user_suffix": str,         # after a user message, up to where the answer begins
     "end_of_turn_id": int,      # closes an answer; one of eos_ids
     "trim": ["system" | "user"] # roles whose messages are trimmed of surrounding whitespace
  } | null,
  "shards": [{                                                                     [R: non-empty]
     "index": int, "file": str (no '/'), "sha256": str, "size": int,              [R]
     "data": {"file": str (no '/'), "size": int, "sha256": str},   # optional: the   [R]
                                 # .ptd the program reads weights from (ExecuTorch's named
                                 # data): the tied table the first and last shard share
                                 # (lowering/shared_table.py); runners load the shard with it
     "layers": [first, end),     # decoder layers, end exclusive; continuous over  [R]
                                 # the shards and covering all n_layers
     "has_embedding": bool, "has_head": bool,   # first shard / last shard only     [R]
     "placement": {"backend": str, "options": {...}},
     "backends": [backend id],   # the delegates present (read from the program)   [R: C++, optional]
     "delegates": {method: {backend id: count}},
     "cpu_ops": {method: [operator names]},     # run by ExecuTorch's CPU kernels   [R: optional]
                                 # (runners refuse an export whose operator has no kernel)
     "io": {method: {"inputs": [{"name","shape","dtype"}], "outputs": [...]}},    [R]
                                 # dtype float32|float16|int64|int32|uint8|uint16; a uint8/uint16
                                 # tensor also has "quant": {"scale": float > 0, "zero_point": int}
                                 # (real = (q - zero_point) * scale); hidden and cache tensors are
                                 # float32, float16, uint8 or uint16, logits float32; a layer's cache inputs
                                 # and new-entry outputs share one dtype and quant in every method
     "export_seconds": float, "notes": [str],   # e.g. linears left unquantized
     "cache": "hit" | "stored" | "off",         # taken from the shard cache, put there, or neither
     "spill_fill_bytes": int,    # optional, QNN shards: this shard's own need
     "htp_context_bytes": int,   # optional, QNN shards: its context binaries' bytes
     "weight_sharing": bool,     # optional, QNN shards: decode and prefill share    [R]
                                 # one copy of the weights; the x86 simulator cannot
                                 # load such a shard, so runners there refuse it
     "sqnr_db": {method: {output name: float | null}}   # optional, QNN shards: against the
                                 # float shard on held-out input; null = exact (no error)
     "sqnr_worst_token_db": {method: float | null}    # optional, QNN shards: the same for
                                 # the main output's worst token (a massive activation on one
                                 # token dominates the whole tensor's figure)
  }],
  "qnn": {"build_id": str, "spill_fill_bytes": int,                               [R: C++]
          "libraries": str, "calibration_seconds": float | null} | null,
                                 # build_id: the QNN libraries the shards were compiled with (the
                                 # C++ runner warns when it loads others); spill_fill_bytes: the
                                 # one size shared by every QNN context
  "versions": {"composite", "torch", "executorch", "torchao"}
}
Input names: "tokens" [1,T] int64 | "hidden" [1,T,dim]; then, for shards with layers, "input_pos"
[T] int64, "mask", and "k_cache.L", "v_cache.L" per layer L; the last shard's multi-token methods
end with "logits_index" [1] int64 (the row of the last valid token), but for "verify". Outputs:
"hidden" [1,T,dim] | "logits" [1,1,vocab] (the last token's only; "verify": [1,T,vocab], every
row's), then "k_new.L", "v_new.L" per layer. Each of the T tokens sits at its own input_pos and sees
what its mask row shows: "verify" calls carry a tree of guesses, each row seeing its ancestors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from composite.errors import UserError

FORMAT = "composite-manifest"
VERSION = 2
FILENAME = "manifest.json"
FLOAT32_MAX = 3.4028234663852886e38
MASK_HIDDEN = -30000.0  # finite so fp16 backends represent it; exp() of it is 0 in fp32
DECODE, PREFILL, VERIFY = "decode", "prefill", "verify"


def method_widths(prefill_len: int, verify_len: int = 0) -> dict[str, int]:
    """Every shard's methods and the tokens each takes per call: the one place that says so.
    verify_len 0: no verify method."""
    return {DECODE: 1, PREFILL: prefill_len} | ({VERIFY: verify_len} if verify_len else {})


def every_row_logits(method: str) -> bool:
    """The head shard's `method` gives logits for every row of the call (it takes no logits_index)."""
    return method == VERIFY


def takes_logits_index(method: str, width: int) -> bool:
    """The head shard's `method` takes logits_index: the row whose logits it gives."""
    return width > 1 and not every_row_logits(method)


CHAT_TRIM_ROLES = ("system", "user")

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
QUANTIZED_DTYPES = {"uint8": 255, "uint16": 65535}  # dtype -> largest value
CACHE_PREFIXES = ("k_cache.", "v_cache.", "k_new.", "v_new.")
VALUE_DTYPES = ("float32", "float16", *QUANTIZED_DTYPES)  # of hidden states and caches
DTYPE_BYTES = {"float32": 4, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "uint16": 2}
DTYPE_NAMES = {torch_name: name for name, (torch_name, _) in DTYPES.items()}
SCALAR_TYPE_NAMES = {code: name for name, (_, code) in DTYPES.items()}


def dtype_name(dtype) -> str:
    return DTYPE_NAMES[str(dtype)]


def tensor_bytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * DTYPE_BYTES[entry["dtype"]]


def memory_figures(manifest: dict) -> dict:
    """Bytes the runners hold and move, from the manifest alone (composite_runner's memory_figures
    computes the same): the KV cache in all and per shard, and what each shard takes in and gives
    out per decode step (the cache it reads included)."""
    per_shard = [
        sum(tensor_bytes(t) for t in s["io"][DECODE]["inputs"] if t["name"].startswith(("k_cache.", "v_cache.")))
        for s in manifest["shards"]
    ]
    io = [
        {
            "in": sum(tensor_bytes(t) for t in s["io"][DECODE]["inputs"]),
            "out": sum(tensor_bytes(t) for t in s["io"][DECODE]["outputs"]),
        }
        for s in manifest["shards"]
    ]
    return {"kv_cache_bytes": sum(per_shard), "kv_cache_bytes_per_shard": per_shard, "decode_io_bytes_per_shard": io}


def read(folder: Path) -> dict:
    """Load and check `folder`/manifest.json (the files beside it: manifest_files.py)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"artifacts folder {folder} does not exist")
    try:
        text = (folder / FILENAME).read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        raise UserError(f"{folder}/{FILENAME} does not exist: is {folder} an export folder?") from None
    except OSError as e:
        raise UserError(f"cannot read {folder}/{FILENAME}: {e.strerror}") from None
    return parse(text, str(folder))


# The checks below are runner_cpp/manifest.cpp's parse_manifest, in the same order and with the
# same messages: both runners accept and refuse the same manifests (tests/manifests holds cases).


def _dump(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _require(obj, key: str, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise UserError(f"{where} has no '{key}'")
    return obj[key]


def _integer(value, what: str, bits: int = 32) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{what} must be an integer, got {_dump(value)}")
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise UserError(f"{what} is out of range: {_dump(value)}")
    return value


def _integers(value, what: str, bits: int = 64) -> list[int]:
    if not isinstance(value, list):
        raise UserError(f"{what} must be a list of integers")
    return [_integer(v, what, bits) for v in value]


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{what} must be a string, got {_dump(value)}")
    return value


def _boolean(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{what} must be true or false, got {_dump(value)}")
    return value


def _require_int(obj, key: str, where: str) -> int:
    return _integer(_require(obj, key, where), f"{where} '{key}'")


def _require_text(obj, key: str, where: str) -> str:
    return _text(_require(obj, key, where), f"{where} '{key}'")


def _check_tensors(value, where: str) -> None:
    if not isinstance(value, list):
        raise UserError(f"{where} is not a list")
    for tensor in value:
        name = _require_text(tensor, "name", where)
        shape = _integers(_require(tensor, "shape", where), f"{where} shape")
        dtype = _require_text(tensor, "dtype", where)
        if dtype not in DTYPES:
            raise UserError(f"{where}: tensor {name} has dtype {_dump(dtype)}, not one of {', '.join(DTYPES)}")
        if any(d <= 0 for d in shape):
            raise UserError(f"{where}: tensor {name} has a non-positive dimension")
        _check_quant(tensor, dtype, f"{where}: tensor {name}")


def _check_quant(tensor: dict, dtype: str, what: str) -> None:
    """A uint8 / uint16 tensor carries its scale and zero point; no other tensor does."""
    if dtype not in QUANTIZED_DTYPES:
        if "quant" in tensor:
            raise UserError(f"{what} has 'quant' but is {dtype}; only uint8 and uint16 tensors are quantized")
        return
    if "quant" not in tensor:
        raise UserError(f"{what} is {dtype} and needs 'quant' with its scale and zero_point")
    quant = tensor["quant"]
    scale = _require(quant, "scale", f"{what} quant")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= FLOAT32_MAX:
        raise UserError(f"{what} quant 'scale' must be a positive number, got {_dump(scale)}")
    zero_point = _require(quant, "zero_point", f"{what} quant")
    top = QUANTIZED_DTYPES[dtype]
    if isinstance(zero_point, bool) or not isinstance(zero_point, int) or not 0 <= zero_point <= top:
        raise UserError(f"{what} quant 'zero_point' must be an integer from 0 to {top}, got {_dump(zero_point)}")


def _check_value_dtypes(io: dict, where: str) -> None:
    """The runners feed and read hidden states and caches as float32, float16, uint8 or uint16, and
    sample float32 logits."""
    for method, sides in io.items():
        for side in ("inputs", "outputs"):
            for tensor in sides[side]:
                name, dtype = tensor["name"], tensor["dtype"]
                if name == "logits" and dtype != "float32":
                    raise UserError(f"{where} {method} {side}: tensor logits must be float32, got {dtype}")
                if (name == "hidden" or name.startswith(CACHE_PREFIXES)) and dtype not in VALUE_DTYPES:
                    raise UserError(
                        f"{where} {method} {side}: tensor {name} must be float32, float16, uint8 or uint16, got {dtype}"
                    )


def _check_cache_encodings(io: dict, first: int, end: int, where: str) -> None:
    """The runner copies a layer's new entries into its cache as they are: cache inputs and
    new-entry outputs of every method share one dtype and quantization."""
    for layer in range(first, end):
        for kind in ("k", "v"):
            encodings = set()
            for method in io.values():
                for side, name in (("inputs", f"{kind}_cache.{layer}"), ("outputs", f"{kind}_new.{layer}")):
                    for tensor in method[side]:
                        if tensor["name"] == name:
                            quant = tensor.get("quant") or {}
                            encodings.add((tensor["dtype"], quant.get("scale"), quant.get("zero_point")))
            if len(encodings) > 1:
                raise UserError(
                    f"{where}: {kind}_cache.{layer} and {kind}_new.{layer} must have one dtype and quantization "
                    "in every method"
                )


def parse(text: str, folder: str) -> dict:
    where = f"{folder}/{FILENAME}"
    try:
        j = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is malformed JSON: {e}") from None
    if not isinstance(j, dict) or j.get("format") != FORMAT:
        raise UserError(f"{where} is not a composite manifest")
    version = j.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != VERSION:
        shown = "null" if version is None else _dump(version)
        raise UserError(f"{where}: manifest version {shown} is not supported (this runner reads {VERSION})")
    _require(j, "export_id", where)
    dims = _model_dims(j, where)
    max_seq_len = _require_int(j, "max_seq_len", where)
    if max_seq_len < 2 or dims["vocab_size"] < 1 or dims["n_layers"] < 0:
        raise UserError(f"{where}: max_seq_len, vocab_size or n_layers is out of range")
    methods = _require(j, "methods", where)
    if not isinstance(methods, dict):
        raise UserError(f"{where}: 'methods' must map method names to widths")
    widths = {name: _integer(width, f"{where} method {name}") for name, width in sorted(methods.items())}
    if widths.get(DECODE) != 1:
        raise UserError(f"{where}: needs a 'decode' method of 1 token per call")
    for name, width in sorted(widths.items()):
        if not 1 <= width <= max_seq_len:
            raise UserError(f"{where}: method {name} has an invalid width")
    kv = _require(j, "kv_cache", where)
    if _require_text(kv, "dtype", f"{where} kv_cache") != "float32":
        raise UserError(f"{where}: only float32 KV caches are supported by this runner")
    k_shape = _integers(_require(kv, "k_shape", f"{where} kv_cache"), f"{where} kv_cache k_shape")
    v_shape = _integers(_require(kv, "v_shape", f"{where} kv_cache"), f"{where} kv_cache v_shape")
    kv_heads, head_dim = dims["n_kv_heads"], dims["head_dim"]
    if k_shape != [kv_heads, head_dim, max_seq_len] or v_shape != [kv_heads, max_seq_len, head_dim]:
        raise UserError(f"{where}: kv_cache shapes do not match the model and max_seq_len")
    hidden = _require(_require(j, "mask", where), "hidden", f"{where} mask")
    if isinstance(hidden, bool) or not isinstance(hidden, (int, float)) or not abs(hidden) <= FLOAT32_MAX:
        raise UserError(f"{where}: mask 'hidden' must be a finite float32 number")
    tokenizer = _require(j, "tokenizer", where)
    if tokenizer is not None:
        _require_text(tokenizer, "file", f"{where} tokenizer")
        _require_text(tokenizer, "type", f"{where} tokenizer")
    bos = _require(j, "bos_id", where)
    if bos is not None:
        _integer(bos, f"{where} bos_id", 64)
    eos_ids = _integers(_require(j, "eos_ids", where), f"{where} eos_ids")
    if j.get("chat") is not None:
        end_of_turn = check_chat(j["chat"], f"{where} chat")
        if end_of_turn not in eos_ids:
            raise UserError(f"{where} chat: end_of_turn_id {end_of_turn} is not one of eos_ids")
    shards = _require(j, "shards", where)
    if not isinstance(shards, list) or not shards:
        raise UserError(f"{where}: 'shards' must be a non-empty list")
    expected_layer = 0
    for i, shard in enumerate(shards):
        expected_layer = _check_shard(shard, i, len(shards), expected_layer, dims["n_layers"], widths, where)
    if expected_layer != dims["n_layers"]:
        raise UserError(f"{where}: the shards do not cover all layers")
    if j.get("qnn") is not None:
        _require_text(j["qnn"], "build_id", f"{where} qnn")
        _integer(_require(j["qnn"], "spill_fill_bytes", f"{where} qnn"), f"{where} qnn spill_fill_bytes", 64)
    return j


def _check_shard(shard, i: int, count: int, expected_layer: int, n_layers: int, widths: dict, where: str) -> int:
    """Shard i of `count` (manifest.cpp's checks of a shard, in its order); -> the layer the next
    shard must start at."""
    sw = f"{where} shard {i}"
    index = _require_int(shard, "index", sw)
    if index != i:
        raise UserError(f"{sw} says index {index}: shards are out of order")
    if "/" in _require_text(shard, "file", sw):
        raise UserError(f"{sw}: file name must not contain '/'")
    _require_text(shard, "sha256", sw)
    _integer(_require(shard, "size", sw), f"{sw} size", 64)
    if "data" in shard:
        data = shard["data"]
        if not isinstance(data, dict):
            raise UserError(f"{sw} 'data' must name a file with its size and sha256")
        if "/" in _require_text(data, "file", f"{sw} data"):
            raise UserError(f"{sw}: data file name must not contain '/'")
        _require_text(data, "sha256", f"{sw} data")
        _integer(_require(data, "size", f"{sw} data"), f"{sw} data size", 64)
    layers = _integers(_require(shard, "layers", sw), f"{sw} layers", 32)
    if len(layers) != 2 or layers[0] != expected_layer or layers[1] < layers[0] or layers[1] > n_layers:
        raise UserError(f"{sw}: layers do not continue the chain at layer {expected_layer}")
    has_embedding = _boolean(_require(shard, "has_embedding", sw), f"{sw} 'has_embedding'")
    has_head = _boolean(_require(shard, "has_head", sw), f"{sw} 'has_head'")
    if has_embedding != (i == 0) or has_head != (i + 1 == count):
        raise UserError(f"{sw}: the embedding must be in the first shard and the head in the last")
    if "backends" in shard:
        if not isinstance(shard["backends"], list):
            raise UserError(f"{sw} 'backends' must be a list of names")
        for backend in shard["backends"]:
            _text(backend, f"{sw} 'backends'")
    if "cpu_ops" in shard:
        ops = shard["cpu_ops"]
        if not isinstance(ops, dict) or not all(isinstance(v, list) for v in ops.values()):
            raise UserError(f"{sw} 'cpu_ops' must map methods to lists of operator names")
        for name in sorted(ops):
            for op in ops[name]:
                _text(op, f"{sw} 'cpu_ops'")
    if "weight_sharing" in shard:
        _boolean(shard["weight_sharing"], f"{sw} 'weight_sharing'")
    io = _require(shard, "io", sw)
    for name in sorted(widths):
        method = _require(io, name, f"{sw} io")
        _check_tensors(_require(method, "inputs", sw), f"{sw} {name} inputs")
        _check_tensors(_require(method, "outputs", sw), f"{sw} {name} outputs")
    _check_value_dtypes({name: io[name] for name in sorted(widths)}, sw)
    _check_cache_encodings({name: io[name] for name in sorted(widths)}, layers[0], layers[1], sw)
    return layers[1]


def _model_dims(j: dict, where: str) -> dict:
    """The model's six dimensions the runners read, and its optional "rope" entry checked."""
    model = _require(j, "model", where)
    dims = {
        key: _require_int(model, key, f"{where} model")
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
    }
    rope = j.get("rope")
    if rope is not None:
        freqs = _require(rope, "inv_freq", f"{where} rope")
        if rope.get("convention") != "rotate-half" or not isinstance(freqs, list) or len(freqs) * 2 != dims["head_dim"]:
            raise UserError(f"{where}: rope must be rotate-half with head_dim / 2 inv_freq numbers")
        if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) for f in freqs):
            raise UserError(f"{where}: rope inv_freq must hold finite numbers")
    return dims


def check_chat(chat, where: str) -> int:
    """A "chat" entry (the manifest's, or a runner's --chat_template file); -> its end_of_turn_id."""
    for key in ("source", "first_user_prefix", "user_prefix", "user_suffix"):
        _require_text(chat, key, where)
    system = [_require(chat, key, where) for key in ("system_prefix", "system_suffix")]
    for key, value in zip(("system_prefix", "system_suffix"), system):
        if value is not None:
            _text(value, f"{where} '{key}'")
    if (system[0] is None) != (system[1] is None):
        raise UserError(f"{where}: system_prefix and system_suffix must both be text or both null")
    end_of_turn = _integer(_require(chat, "end_of_turn_id", where), f"{where} end_of_turn_id", 64)
    trim = _require(chat, "trim", where)
    if not isinstance(trim, list) or not all(role in CHAT_TRIM_ROLES for role in trim):
        raise UserError(f"{where} 'trim' must be a list of roles (system, user), got {_dump(trim)}")
    return end_of_turn
