"""llama-architecture GGUF files (llama.cpp, ollama, LM Studio) read as checkpoints.

Weights: every tensor dequantized to float32 by ggml-org's `gguf` package, renamed to Meta's
names. The q/k rows stay in llama.cpp's interleaved rotary layout, which is Meta's:
model/checkpoint.py turns them into rotate-half as it does for Meta checkpoints.
Hyper-parameters: the `llama.*` metadata. Tokenizer: the `tokenizer.ggml.*` vocabulary written as
a file both runners read (tokenizer.json for byte-level BPE vocabularies, tokenizer.model for
SentencePiece ones), with a tokenizer_config.json beside it naming the special tokens, as a Hugging
Face folder would; `tokenizer.chat_template` is the chat template.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from composite.errors import UserError
from composite.model.llama import ModelArgs
from composite.model.weights import GgufWeights

ARCHITECTURE = "llama"

# GGUF tensor names -> Meta's (blk.N.* per layer).
TENSOR_NAMES = {
    "token_embd": "tok_embeddings",
    "output_norm": "norm",
    "output": "output",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3",
}
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1 GGUFs store the scaled rotary frequencies' divisors

# How text is cut before byte-level BPE, by `tokenizer.ggml.pre`: what each vocabulary's own
# tokenizer.json does (Llama 3: its split pattern, merges ignored for words in the vocabulary;
# SmolLM: each digit alone, then GPT-2's pattern; GPT-2: its pattern). "default" is what
# llama.cpp's converter writes when it does not recognise a vocabulary: GPT-2's pattern, as
# transformers reads such files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smollm": "smollm",
    "gpt2": "gpt2",
    "default": "gpt2",
}
# tokenizer.ggml.token_type values, as llama.cpp and SentencePiece number them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GgufCheckpoint:
    args: ModelArgs
    weights: GgufWeights  # Meta names; q/k rows interleaved as Meta's until model/checkpoint.py says
    tokenizer_path: Path | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: tuple[str, str] | None  # (Jinja, where from)
    notes: list[str]


class Metadata:
    def __init__(self, reader, path: Path):
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise UserError(f"GGUF file {self.path}: metadata '{key}' is unreadable ({e})") from None

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise UserError(f"GGUF file {self.path} has no '{key}' metadata")
        return value


def open_reader(path: Path):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except PermissionError:
        raise UserError(f"checkpoint {path} is not readable (permission denied)") from None
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "magic" in detail.lower():
            raise UserError(f"checkpoint {path} is not a GGUF file") from None
        raise UserError(f"GGUF file {path} is truncated or corrupt: {detail}") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise UserError(
                f"GGUF file {path} is truncated: tensor '{tensor.name}' ends at byte "
                f"{int(tensor.data_offset) + int(tensor.n_bytes)} of a {size}-byte file"
            )
    return reader


def meta_tensor_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if base in TENSOR_NAMES:
        return f"{TENSOR_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSOR_NAMES:
        return f"layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.weight"
    return None


def read_gguf(path: Path) -> GgufCheckpoint:
    reader = open_reader(path)
    meta = Metadata(reader, path)
    architecture = meta.require("general.architecture")
    if architecture != ARCHITECTURE:
        raise UserError(f"GGUF file {path} holds a '{architecture}' model; only the llama architecture is supported")
    weights, rope_factors, types = tensor_index(reader, path)
    args = model_args(meta, weights.shapes, rope_factors)
    described = ", ".join(f"{name} {count}" for name, count in types.most_common())
    notes = []
    quantized = {t for t in types if t not in ("F32", "F16", "BF16", "F64")}
    if quantized:
        notes.append(
            f"{path.name}'s weights were already quantized ({described} tensors): exported from their float32 "
            "dequantization, so the float model is the dequantized file, not the original weights"
        )
    tokenizer_path, bos_id, eos_ids = write_tokenizer(meta, args.vocab_size)
    template = meta.get("tokenizer.chat_template")
    chat_template = (template, f"{path.name} tokenizer.chat_template") if isinstance(template, str) else None
    return GgufCheckpoint(args, weights, tokenizer_path, bos_id, eos_ids, chat_template, notes)


def tensor_index(reader, path: Path) -> tuple[GgufWeights, torch.Tensor | None, Counter]:
    """The file's tensors by Meta name, to be read when asked for; the rotary factors (a few
    values) read now. A tensor type the gguf package cannot dequantize is refused here, before
    any long work: one row of the first tensor of each type is dequantized to find out."""
    from gguf.quants import dequantize

    located, shapes = {}, {}
    rope_factors = None
    types: Counter = Counter()
    tried = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in tried:
            tried.add(kind)
            try:
                dequantize(np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])[:1], tensor.tensor_type)
            except NotImplementedError:
                raise UserError(
                    f"GGUF file {path}: tensor '{tensor.name}' has type {kind}, which the gguf package cannot "
                    "dequantize"
                ) from None
            except ValueError as e:
                raise UserError(f"GGUF file {path} is truncated or corrupt: tensor '{tensor.name}': {e}") from None
        types[kind] += 1
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if tensor.name == ROPE_FACTORS:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            rope_factors = torch.from_numpy(values.copy()).flatten()
            continue
        name = meta_tensor_name(tensor.name)
        if name is None:
            raise UserError(
                f"GGUF file {path} has tensor '{tensor.name}', which a llama model of this tool does not have "
                "(biases, experts and other extras are not supported)"
            )
        located[name] = (
            int(tensor.data_offset),
            int(tensor.n_bytes),
            tensor.data.dtype,
            tensor.data.shape,
            tensor.tensor_type,
        )
        shapes[name] = shape
    return GgufWeights(path, located, shapes), rope_factors, types


def _positive_int(meta: Metadata, key: str, value) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise UserError(
                f"GGUF file {meta.path}: '{key}' differs between layers ({sorted(set(value))}), unsupported"
            )
        value = value[0]
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise UserError(f"GGUF file {meta.path}: '{key}' must be a positive integer, got {value!r}")
    return int(value)


def model_args(meta: Metadata, shapes: dict[str, tuple], rope_factors: torch.Tensor | None) -> ModelArgs:
    def number(key: str, default=None):
        value = meta.get(f"{ARCHITECTURE}.{key}", default)
        if value is None:
            raise UserError(f"GGUF file {meta.path} has no '{ARCHITECTURE}.{key}' metadata")
        return value

    if meta.get(f"{ARCHITECTURE}.expert_count", 0):
        raise UserError(f"GGUF file {meta.path} is a mixture-of-experts model, which is not supported")
    dim = _positive_int(meta, "embedding_length", number("embedding_length"))
    n_heads = _positive_int(meta, "attention.head_count", number("attention.head_count"))
    n_kv_heads = _positive_int(meta, "attention.head_count_kv", number("attention.head_count_kv", n_heads))
    head_dim = _positive_int(meta, "attention.key_length", number("attention.key_length", dim // n_heads))
    value_dim = _positive_int(meta, "attention.value_length", number("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UserError(
            f"GGUF file {meta.path}: key length {head_dim} and value length {value_dim} differ, unsupported"
        )
    rotary = _positive_int(meta, "rope.dimension_count", number("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise UserError(
            f"GGUF file {meta.path}: rotary embeddings cover {rotary} of {head_dim} head dimensions; "
            "only full rotary embeddings are supported"
        )
    embedding = shapes.get("tok_embeddings.weight")
    vocab = meta.get(f"{ARCHITECTURE}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else (embedding[0] if embedding is not None else None)
    scaling = None
    scaling_type = meta.get(f"{ARCHITECTURE}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"type": "linear", "factor": float(number("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise UserError(f"GGUF file {meta.path}: rope scaling '{scaling_type}' is not supported (none, linear are)")
    if rope_factors is not None:
        if scaling is not None:
            raise UserError(f"GGUF file {meta.path} has both rope scaling metadata and rope_freqs, unsupported")
        if rope_factors.numel() != head_dim // 2:
            raise UserError(
                f"GGUF file {meta.path}: rope_freqs has {rope_factors.numel()} values, head_dim {head_dim} needs "
                f"{head_dim // 2}"
            )
        scaling = {"type": "factors", "factors": [float(f) for f in rope_factors]}
    return ModelArgs(
        dim=dim,
        n_layers=_positive_int(meta, "block_count", number("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=_positive_int(meta, "vocab_size", vocab),
        hidden_dim=_positive_int(meta, "feed_forward_length", number("feed_forward_length")),
        head_dim=head_dim,
        norm_eps=float(number("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(number("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in shapes,
    )


def _token_id(meta: Metadata, key: str, n_tokens: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)) or not 0 <= value < n_tokens:
        raise UserError(f"GGUF file {meta.path}: tokenizer.ggml.{key} {value!r} is not a token of its vocabulary")
    return int(value)


def write_tokenizer(meta: Metadata, vocab_size: int) -> tuple[Path | None, int | None, tuple[int, ...]]:
    """The vocabulary as a tokenizer file in a folder of its own (removed at exit), with
    tokenizer_config.json beside it naming the special tokens. -> (tokenizer path or None, BOS id,
    stop ids)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        print(f"note: GGUF file {meta.path} has no vocabulary; runners will need --prompt-ids", file=sys.stderr)
        return None, None, ()
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(f"GGUF file {meta.path}: {len(types)} token types for {len(tokens)} tokens")
    bos = _token_id(meta, "bos_token_id", len(tokens))
    eos = _token_id(meta, "eos_token_id", len(tokens))
    stops = {eos, _token_id(meta, "eot_token_id", len(tokens)), _token_id(meta, "eom_token_id", len(tokens))}
    if meta.get("tokenizer.ggml.add_eos_token"):
        raise UserError(f"GGUF file {meta.path}: its tokenizer adds EOS after every text, which the runners do not do")
    folder = Path(tempfile.mkdtemp(prefix="composite-gguf-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    if kind == "gpt2":
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        path = write_byte_level_bpe(meta, tokens, types, bos if add_bos else None, folder / "tokenizer.json")
    elif kind == "llama":
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        path = write_sentencepiece(meta, tokens, types, bos, eos, folder / "tokenizer.model")
    else:
        raise UserError(
            f"GGUF file {meta.path} has a '{kind}' vocabulary; byte-level BPE ('gpt2') and SentencePiece ('llama') "
            "are supported"
        )
    config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": add_bos,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    return path, bos if add_bos else None, tuple(sorted(s for s in stops if s is not None))


def write_byte_level_bpe(meta: Metadata, tokens: list[str], types: list[int], bos: int | None, path: Path) -> Path:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UserError(
            f"GGUF file {meta.path}: pre-tokenizer '{pre}' is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = meta.require("tokenizer.ggml.merges")
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise UserError(f"GGUF file {meta.path}: merge {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise UserError(f"GGUF file {meta.path}: token {token!r} appears twice (ids {vocab[token]} and {index})")
        vocab[token] = index
    family = PRE_TOKENIZERS[pre]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=family == "llama3"))
    if family == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif family == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        steps.append(processors.TemplateProcessing(single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]))
    tokenizer.post_processor = processors.Sequence(steps)
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(plain)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise UserError(f"GGUF file {meta.path}: its vocabulary does not rebuild into {len(tokens)} tokens")
    tokenizer.save(str(path))
    return path


def write_sentencepiece(
    meta: Metadata, tokens: list[str], types: list[int], bos: int | None, eos: int | None, path: Path
) -> Path:
    """A SentencePiece model in Llama 2's form: BPE pieces with their scores, whitespace as '▁',
    a dummy prefix unless tokenizer.ggml.add_space_prefix says otherwise, byte fallback when the
    vocabulary has byte pieces."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise UserError(f"GGUF file {meta.path}: {len(scores)} token scores for {len(tokens)} tokens")
    proto = model_pb2.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = token, float(score)
        piece.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    unknown = _token_id(meta, "unknown_token_id", len(tokens))
    if unknown is None:
        unknown = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
    if unknown is None:
        raise UserError(f"GGUF file {meta.path}: its SentencePiece vocabulary has no unknown token")
    trainer = proto.trainer_spec
    trainer.model_type = model_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = BYTE in types
    trainer.unk_id = unknown
    trainer.bos_id = -1 if bos is None else bos
    trainer.eos_id = -1 if eos is None else eos
    pad = _token_id(meta, "padding_token_id", len(tokens))
    trainer.pad_id = -1 if pad is None or pad in (unknown, bos, eos) else pad
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    path.write_bytes(proto.SerializeToString())
    return path
