"""Open a Meta checkpoint, a Hugging Face folder, a llama GGUF file or the embedded default: its
hyper-parameters, and its tensors as a lazy source (model/weights.py) checked against them, saying
clearly when they do not fit. Nothing is read into memory until a part of the model is asked for."""

from __future__ import annotations

import sys
from pathlib import Path

from composite.errors import UserError
from composite.model.default import load_default
from composite.model.gguf_file import read_gguf
from composite.model.llama import ModelArgs
from composite.model.loaded import LoadedModel, expected_shapes
from composite.model.params import args_from_hf_config, args_from_meta_params, read_json
from composite.model.weights import (
    SafetensorsWeights,
    TorchFileWeights,
    WeightSource,
    load_torch_file,
    state_dict_of,
)

# Keys found in real checkpoints that carry no weights we need.
IGNORED_KEYS = ("rope.freqs",)


def check_shapes(args: ModelArgs, weights: WeightSource, params_source: str) -> None:
    """Every tensor `args` implies is in `weights` with its shape, and nothing else is; or one
    line naming the first that does not fit."""
    source = weights.where
    expected = expected_shapes(args)
    for key, shape in expected.items():
        if key not in weights.shapes:
            raise UserError(f"{source} has no tensor '{key}' that {params_source} implies")
        got = tuple(weights.shapes[key])
        if got != tuple(shape):
            raise UserError(f"{source}: '{key}' has shape {list(got)} but {params_source} implies {list(shape)}")
    unexpected = sorted(set(weights.shapes) - set(expected))
    if unexpected:
        raise UserError(f"{source} has tensors that {params_source} does not describe, e.g. '{unexpected[0]}'")


def permute_qk(args: ModelArgs, weights: WeightSource) -> None:
    """Meta and GGUF files keep q/k rows in interleaved rotary pairs: read them as rotate-half."""
    for i in range(args.n_layers):
        for name, heads in (("wq", args.n_heads), ("wk", args.n_kv_heads)):
            key = f"layers.{i}.attention.{name}.weight"
            if key in weights.shapes and weights.shapes[key][0] == heads * args.head_dim:
                weights.permuted[key] = heads


def load_meta(checkpoint: Path, params_path: Path | None) -> LoadedModel:
    if checkpoint.is_dir():
        files = sorted(checkpoint.glob("consolidated.*.pth"))
        if not files:
            raise UserError(f"{checkpoint} is a folder without consolidated.00.pth or config.json")
        if len(files) > 1:
            raise UserError(f"{checkpoint} holds {len(files)} model-parallel files; merge them into one first")
        checkpoint = files[0]
    if not checkpoint.exists():
        raise UserError(f"checkpoint {checkpoint} does not exist")
    data = load_torch_file(checkpoint)
    # llama2.c checkpoints (stories*.pt) wrap the weights and carry their own hyper-parameters.
    embedded_params = data.get("model_args") if isinstance(data.get("model_args"), dict) else None
    stored = state_dict_of(data)
    shapes = {k: tuple(v.shape) for k, v in stored.items() if k not in IGNORED_KEYS}
    del data, stored  # the file's pages go with them; tensors are read again one part at a time
    if not shapes:
        raise UserError(f"checkpoint {checkpoint} holds no tensors")
    if params_path is None and (checkpoint.parent / "params.json").exists():
        params_path = checkpoint.parent / "params.json"
    if params_path is not None:
        params, params_source = read_json(params_path), str(params_path)
    elif embedded_params is not None:
        params, params_source = embedded_params, f"{checkpoint}'s model_args"
    else:
        raise UserError(f"no params.json beside {checkpoint}; pass --params PATH")
    embedding = shapes.get("tok_embeddings.weight")
    # Meta's Llama 3.2 1B/3B checkpoints leave the tied output projection out.
    args = args_from_meta_params(
        params,
        Path(params_source),
        None if embedding is None else embedding[0],
        tied="output.weight" not in shapes,
    )
    weights = TorchFileWeights(checkpoint, {name: name for name in shapes}, shapes)
    permute_qk(args, weights)
    check_shapes(args, weights, params_source)
    tokenizer = checkpoint.parent / "tokenizer.model"
    return LoadedModel(args, weights, "meta", str(checkpoint), tokenizer if tokenizer.exists() else None)


HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_to_meta_name(name: str) -> str:
    if name in HF_NAMES:
        return HF_NAMES[name]
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        inner = ".".join(parts[3:-1])
        if inner in HF_LAYER_NAMES:
            return f"layers.{parts[2]}.{HF_LAYER_NAMES[inner]}.{parts[-1]}"
    return name


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has config.json but no *.safetensors weights")
    for f in files:
        if not f.exists():
            raise UserError(f"{f} is listed in the safetensors index but does not exist")
    return files


def load_hf(folder: Path) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    config = read_json(folder / "config.json")
    args = args_from_hf_config(config, folder / "config.json")
    located, shapes = {}, {}
    for path in _safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    located[hf_to_meta_name(name)] = (path, name)
                    shapes[hf_to_meta_name(name)] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path} is corrupt or unreadable: {e}") from None
    weights = SafetensorsWeights(located, shapes, str(folder))
    check_shapes(args, weights, str(folder / "config.json"))
    tokenizer = None
    for candidate in ("tokenizer.model", "original/tokenizer.model", "tokenizer.json"):
        if (folder / candidate).exists():
            tokenizer = folder / candidate
            break
    return LoadedModel(
        args, weights, "hf", str(folder), tokenizer, config.get("bos_token_id"), stop_ids(folder, config)
    )


def stop_ids(folder: Path, config: dict) -> tuple[int, ...]:
    """Every eos_token_id config.json and generation_config.json name (an id or a list: Llama 3
    Instruct lists end of text, end of message and end of turn)."""
    ids: set[int] = set()
    generation = folder / "generation_config.json"
    for source in (config, read_json(generation) if generation.exists() else {}):
        eos = source.get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
    return tuple(sorted(ids))


def load_gguf(path: Path) -> LoadedModel:
    """A llama-architecture GGUF file: q/k rows in llama.cpp's layout, which is Meta's."""
    gguf = read_gguf(path)
    permute_qk(gguf.args, gguf.weights)
    check_shapes(gguf.args, gguf.weights, f"{path}'s metadata")
    for note in gguf.notes:
        print(f"note: {note}", file=sys.stderr)
    return LoadedModel(
        gguf.args, gguf.weights, "gguf", str(path), gguf.tokenizer_path, gguf.bos_id, gguf.eos_ids, gguf.chat_template
    )


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_checkpoint(checkpoint: str | None, params: str | None) -> LoadedModel:
    """The model named by --checkpoint/--params; the embedded default when no checkpoint is given."""
    if checkpoint is None:
        if params is not None:
            raise UserError("--params needs --checkpoint")
        return load_default()
    path = Path(checkpoint)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if path.is_dir() and (path / "config.json").exists():
        if params is not None:
            raise UserError("--params is for Meta checkpoints; a Hugging Face folder has its config.json")
        return load_hf(path)
    if path.is_file() and is_gguf(path):
        if params is not None:
            raise UserError("--params is for Meta checkpoints; a GGUF file carries its hyper-parameters")
        return load_gguf(path)
    return load_meta(path, Path(params) if params else None)
