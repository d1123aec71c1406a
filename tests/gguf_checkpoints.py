"""GGUF files written by the tests themselves (ggml-org's gguf package), as llama.cpp's
convert_hf_to_gguf.py lays them out: q/k rows permuted into llama.cpp's interleaved rotary
layout, norms in F32, chosen tensors quantized."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-Instruct's template: ChatML, with a default system message when none is given.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NORMAL, CONTROL = 1, 3


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation of q/k rows: rotate-half -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def train_byte_level_bpe(text: str, vocab_size: int, specials: list[str]):
    """A byte-level BPE in Llama 3's style (its split pattern), specials added after the merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.add_special_tokens(specials)
    return tok


def vocabulary(tok) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, their GGUF types, merges as "a b") of a `tokenizers` byte-level BPE."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = [CONTROL if t in specials else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """The float values a Q8_0 tensor dequantizes to, so that a model can be given them before
    anything is computed from it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    data = quantize(weight.detach().numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0).copy())


def write_llama_gguf(
    path: Path,
    hf_model,
    tokens: list[str],
    token_types: list[int],
    merges: list[str] | None,
    *,
    tokenizer_model: str = "gpt2",
    pre: str = "llama-bpe",
    scores: list[float] | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    add_bos: bool = True,
    chat_template: str | None = None,
    q8_0: tuple[str, ...] = (),
    float_type=np.float16,
    architecture: str = "llama",
) -> Path:
    """A GGUF of a transformers LlamaForCausalLM: matrices in `float_type` (F16 or F32), except
    those whose GGUF names are in `q8_0` (e.g. "token_embd", "ffn_down"), stored Q8_0; norms F32."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model(tokenizer_model)
    if tokenizer_model == "gpt2":
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer_names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.down_proj": "ffn_down",
        "mlp.up_proj": "ffn_up",
    }
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for key, tensor in state.items():
        module = key.removesuffix(".weight")
        parts = module.split(".")
        name = names.get(module) or f"blk.{parts[2]}.{layer_names['.'.join(parts[3:])]}"
        data = tensor.detach().float().numpy()
        if name.endswith("attn_q"):
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif name.endswith("attn_k"):
            data = llama_cpp_permute(data, config.num_key_value_heads)
        kind = name.split(".")[-1]
        if data.ndim == 1:
            writer.add_tensor(f"{name}.weight", data.astype(np.float32))
        elif kind in q8_0:
            quantized = quantize(data.astype(np.float32), GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{name}.weight", quantized, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{name}.weight", data.astype(float_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
