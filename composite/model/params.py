"""Model hyper-parameters from Meta `params.json` or Hugging Face `config.json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from composite.errors import UserError
from composite.model.llama import ModelArgs

# Meta's reference code applies Llama 3.1 scaling with these constants when `use_scaled_rope` is set.
# Its params.json does not carry the factor: Llama 3.1 uses 8, Llama 3.2 1B/3B (the models with
# tied embeddings) 32, as their Hugging Face config.json says.
LLAMA3_2_ROPE_FACTOR = 32.0
META_LLAMA3_SCALING = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    return data


def _require(data: dict, key: str, source: Path):
    if key not in data:
        raise UserError(f"{source} has no '{key}'")
    return data[key]


def meta_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def args_from_meta_params(params: dict, source: Path, vocab_size: int | None = None, tied: bool = False) -> ModelArgs:
    """`params.json` of Meta's checkpoints and llama2.c's stories models.

    A vocab_size of -1 (Llama 2's params.json) is taken from the embedding weight. `tied`: the
    checkpoint has no output projection (Llama 3.2 1B/3B), which also picks their rope factor.
    """
    dim = _require(params, "dim", source)
    n_heads = _require(params, "n_heads", source)
    vocab = params.get("vocab_size", -1)
    if vocab in (-1, None):
        if vocab_size is None:
            raise UserError(f"{source} has no vocab_size and it cannot be read from the weights")
        vocab = vocab_size
    scaling = None
    if params.get("use_scaled_rope"):
        scaling = dict(META_LLAMA3_SCALING)
        if "rope_scale_factor" in params:
            scaling["factor"] = float(params["rope_scale_factor"])
        elif tied:
            scaling["factor"] = LLAMA3_2_ROPE_FACTOR
            print(
                f"note: {source} sets use_scaled_rope and the checkpoint ties its embeddings (Llama 3.2 1B/3B): "
                f"rope scaling factor {LLAMA3_2_ROPE_FACTOR:g}; add rope_scale_factor to params.json for another",
                file=sys.stderr,
            )
    hidden = params.get("hidden_dim") or meta_ffn_hidden_dim(
        dim, params.get("multiple_of", 256), params.get("ffn_dim_multiplier")
    )
    return _checked(
        ModelArgs(
            dim=dim,
            n_layers=_require(params, "n_layers", source),
            n_heads=n_heads,
            n_kv_heads=params.get("n_kv_heads") or n_heads,
            vocab_size=vocab,
            hidden_dim=hidden,
            norm_eps=float(params.get("norm_eps", 1e-5)),
            rope_theta=float(params.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_embeddings=tied or bool(params.get("tie_embeddings", False)),
        ),
        source,
    )


def _hf_rope(config: dict, source: Path) -> tuple[float, dict | None]:
    """rope_theta and scaling from either config.json dialect.

    transformers 4: top-level `rope_theta` + optional `rope_scaling`.
    transformers 5: `rope_parameters` holding rope_type, rope_theta and the scaling fields.
    """
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = rope
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        try:
            return float(theta), {
                "type": "llama3",
                "factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            }
        except KeyError as e:
            raise UserError(f"{source}: llama3 rope scaling lacks {e.args[0]}") from None
    raise UserError(f"{source}: rope scaling type '{kind}' is not supported (default, linear, llama3 are)")


def args_from_hf_config(config: dict, source: Path) -> ModelArgs:
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise UserError(f"{source}: model_type '{model_type}' is not supported (only 'llama')")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise UserError(f"{source}: {flag}=true is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{source}: hidden_act '{act}' is not supported (only silu)")
    theta, scaling = _hf_rope(config, source)
    n_heads = _require(config, "num_attention_heads", source)
    return _checked(
        ModelArgs(
            dim=_require(config, "hidden_size", source),
            n_layers=_require(config, "num_hidden_layers", source),
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=_require(config, "vocab_size", source),
            hidden_dim=_require(config, "intermediate_size", source),
            head_dim=config.get("head_dim") or 0,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        ),
        source,
    )


def _checked(args: ModelArgs, source) -> ModelArgs:
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "head_dim"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < (0 if name == "n_layers" else 1):
            raise UserError(f"{source}: {name} must be a positive integer, got {value!r}")
    if args.n_heads % args.n_kv_heads:
        raise UserError(f"{source}: n_heads {args.n_heads} is not a multiple of n_kv_heads {args.n_kv_heads}")
    if args.head_dim % 2:
        raise UserError(f"{source}: head_dim {args.head_dim} must be even for rotary embeddings")
    return args
