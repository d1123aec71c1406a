"""GGUF checkpoints written here with ggml-org's gguf package: a byte-level BPE model with F16 and
Q8_0 tensors and a ChatML template (against transformers' GGUF loader), a SentencePiece one (against
the model and tokenizer it was written from), and the files that must be refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_checkpoints import (
    CHATML_SPECIALS,
    CHATML_TEMPLATE,
    q8_0_round_trip,
    train_byte_level_bpe,
    vocabulary,
    write_llama_gguf,
)

from composite.chat_template import conversation as chat_messages
from composite.model.default import corpus_text, default_model
from composite.tokenizer import Tokenizer, train_sentencepiece
from conftest import MAX_SEQ_LEN, RUNNER, assert_clean_failure, export, run_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

GGUF_NAME = "chat.gguf"
CHAT_SEQ_LEN = 256  # three turns of chat
Q8_0_TENSORS = ("token_embd", "attn_q", "ffn_down")
SYSTEM = "You are a terse robot."
TURNS = ["Tell me about the little robot.", "  And then?  ", "Why 42?"]
TEXTS = [
    "Once upon a time there was a little robot.",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "naïve café, façade; crème brûlée — 12345 and 3.14159",
    "emoji 🙂🚀 and CJK 日本語 한국어, Ελληνικά, русский",
    "runs   of\t\twhitespace  \n\n\n  end  ",
    "a<|im_end|>b <|endoftext|><|im_start|>",
]


def round_to_file_types(model) -> None:
    """Give the model the values its GGUF will hold (Q8_0 or F16 tensors, F32 norms), so that
    anything computed from it (the planted end of turn) holds for the file too."""
    kinds = {"embed_tokens": "token_embd", "q_proj": "attn_q", "down_proj": "ffn_down"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                continue
            kind = next((gguf for hf, gguf in kinds.items() if hf in name), None)
            p.copy_(q8_0_round_trip(p) if kind in Q8_0_TENSORS else p.half().float())


@pytest.fixture(scope="session")
def chat_gguf(workdir):
    """A random Llama with a byte-level BPE vocabulary and a ChatML template. Its first answer ends
    with <|im_end|>: that token's head row is a copy, a little larger, of the row of the third token
    greedy decoding would otherwise give."""
    folder = workdir / "gguf_chat"
    folder.mkdir()
    tok = train_byte_level_bpe(corpus_text(), 600, CHATML_SPECIALS)
    tokens, types, merges = vocabulary(tok)
    ids = {s: tok.token_to_id(s) for s in CHATML_SPECIALS}
    config = transformers.LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CHAT_SEQ_LEN,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=100000.0,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    round_to_file_types(model)

    def write():
        return write_llama_gguf(
            folder / GGUF_NAME,
            model,
            tokens,
            types,
            merges,
            pre="llama-bpe",
            bos_id=ids["<|im_start|>"],
            eos_id=ids["<|im_end|>"],
            add_bos=True,
            chat_template=CHATML_TEMPLATE,
            q8_0=Q8_0_TENSORS,
        )

    write()
    first = template_ids(folder, conversation(TURNS[0]))
    with torch.no_grad():
        greedy = model.generate(torch.tensor([first]), max_new_tokens=3, do_sample=False)[0, len(first) :]
        head = model.lm_head.weight
        head[ids["<|im_end|>"]] = (head[int(greedy[2])] * 1.05).half().float()
    write()
    return model, folder, ids


def hf_tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


def template_ids(folder: Path, messages: list[dict]) -> list[int]:
    """transformers' apply_chat_template with the GGUF's template, tokenized, generation prompt added."""
    encoding = hf_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoding["input_ids"])


def conversation(*turns: str, answers: tuple[str, ...] = (), system: str | None = SYSTEM) -> list[dict]:
    return chat_messages(system, list(turns), list(answers))


@pytest.fixture(scope="session")
def chat_gguf_export(workdir, chat_gguf):
    _, folder, _ = chat_gguf
    return export(workdir / "gguf_chat_export", shards=2, checkpoint=str(folder / GGUF_NAME), max_seq_len=CHAT_SEQ_LEN)


def test_logits_and_greedy_tokens_equal_transformers_gguf_model(chat_gguf, chat_gguf_export):
    _, folder, _ = chat_gguf
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=GGUF_NAME, dtype=torch.float32
    ).eval()
    prompt = hf_tokenizer(folder)("Once upon a time, the robot")["input_ids"]
    from composite.runtime.chain import ShardChain
    from composite.runtime.generate import generate
    from composite.runtime.sampler import Sampler

    generation = generate(ShardChain(chat_gguf_export), prompt, 16, Sampler(), keep_logits=True)
    with torch.no_grad():
        full = reference(torch.tensor([prompt + generation.tokens[:-1]])).logits[0]
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    worst = max((logits - full[p]).abs().max().item() for p, logits in generation.logits.items())
    assert worst < 1e-4
    assert generation.tokens == expected[0, len(prompt) :].tolist()


def test_manifest_records_the_gguf_tokenizer_and_its_template(chat_gguf, chat_gguf_export):
    _, _, ids = chat_gguf
    manifest = json.loads((chat_gguf_export / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "gguf"
    assert manifest["tokenizer"]["type"] == "hf_json" and manifest["tokenizer"]["file"] == "tokenizer.json"
    assert manifest["bos_id"] == ids["<|im_start|>"]
    chat = manifest["chat"]
    assert chat["end_of_turn_id"] == ids["<|im_end|>"] and ids["<|im_end|>"] in manifest["eos_ids"]
    assert chat["first_user_prefix"] == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert chat["user_prefix"] == "\n<|im_start|>user\n" and chat["trim"] == []


@pytest.mark.parametrize("special_as_text", [False, True])
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(chat_gguf, chat_gguf_export, special_as_text):
    _, folder, _ = chat_gguf
    reference = hf_tokenizer(folder)
    ours = Tokenizer(chat_gguf_export / "tokenizer.json")
    tool = RUNNER.parent / "composite_tokenize"
    flags = ["--special-as-text"] if special_as_text else []
    result = subprocess.run(
        [str(tool), "hf_json", str(chat_gguf_export / "tokenizer.json"), *flags],
        input=json.dumps(TEXTS),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    for text, cpp in zip(TEXTS, json.loads(result.stdout)):
        if special_as_text:
            expected = reference(text, split_special_tokens=True)["input_ids"]
        else:
            expected = reference(text)["input_ids"]  # with the BOS the file asks for
        assert ours.encode(text, parse_special=not special_as_text) == expected, text
        assert cpp["ids"] == expected, text


def run_chat(runner: str, export: Path, stats: Path, *flags: str, system: str | None = SYSTEM):
    args = ["--artifacts", str(export), "--chat", "--max_new_tokens", "6", "--stats_json", str(stats), *flags]
    if system is not None:
        args += ["--system", system]
    stdin = "\n".join(TURNS) + "\n"
    if runner == "cpp":
        return subprocess.run([str(RUNNER), *args], input=stdin, capture_output=True, text=True)
    return run_cli_with_input(args, stdin)


def run_cli_with_input(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    import sys

    from conftest import REPO

    return subprocess.run(
        [sys.executable, "-m", "composite.run", *args], input=stdin, capture_output=True, text=True, cwd=REPO
    )


def check_turns_follow_the_template(turns: list[dict], folder: Path, stops: set[int], system: str | None) -> None:
    """At every turn the tokens the runner fed are apply_chat_template's for the conversation so
    far, with the answers as generated: the template's tokens around empty answers, and each
    answer's own tokens where the answer goes."""
    context: list[int] = []  # what the cache holds, in order, answers left out
    for k, turn in enumerate(turns):
        prompt = list(turn["prompt"])
        if k:
            earlier = turns[k - 1]
            carried = [] if earlier["tokens"][-1] in stops else earlier["tokens"][-1:]
            assert prompt[: len(carried)] == carried
            prompt = prompt[len(carried) :]
        context += prompt
        expected = template_ids(folder, conversation(*TURNS[: k + 1], answers=("",) * k, system=system))
        assert context == expected, f"turn {k + 1}"
        assert turn["start_pos"] == sum(len(t["prompt"]) + len(t["tokens"]) - 1 for t in turns[:k])


@pytest.mark.parametrize("runner", ["cpp", "python"])
@pytest.mark.parametrize("system", [SYSTEM, None], ids=["system", "default_system"])
def test_three_turn_chat_feeds_apply_chat_template_and_answers_as_transformers(
    chat_gguf, chat_gguf_export, runner, system, tmp_path
):
    model, folder, ids = chat_gguf
    result = run_chat(runner, chat_gguf_export, tmp_path / "chat.json", system=system)
    assert result.returncode == 0, result.stderr
    turns = json.loads((tmp_path / "chat.json").read_text())["turns"]
    assert len(turns) == 3
    stops = set(json.loads((chat_gguf_export / "manifest.json").read_text())["eos_ids"])
    check_turns_follow_the_template(turns, folder, stops, system)
    if system is not None:
        assert turns[0]["stop_reason"] == "eos" and turns[0]["tokens"][-1] == ids["<|im_end|>"]
    # Every answer is transformers' greedy continuation of the same context.
    cache: list[int] = []
    for turn in turns:
        cache += turn["prompt"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([cache]),
                max_new_tokens=len(turn["tokens"]),
                do_sample=False,
                eos_token_id=sorted(stops),
            )
        assert turn["tokens"] == out[0, len(cache) :].tolist()
        cache += turn["tokens"][:-1]


def test_both_runners_chat_alike_on_the_gguf_export(chat_gguf_export, tmp_path):
    outputs = {}
    for runner in ("cpp", "python"):
        result = run_chat(runner, chat_gguf_export, tmp_path / f"{runner}.json")
        assert result.returncode == 0, result.stderr
        turns = json.loads((tmp_path / f"{runner}.json").read_text())["turns"]
        outputs[runner] = ([(t["prompt"], t["tokens"]) for t in turns], result.stdout)
    assert outputs["cpp"] == outputs["python"]


def test_a_chat_template_file_overrides_the_files_in_export_and_both_runners(chat_gguf, chat_gguf_export, tmp_path):
    """--chat-template: Llama-2-style [INST] turns closed by <|im_end|>, in the export and, as JSON
    (composite.chat_template) or Jinja (composite.run only), in the runners."""
    template = tmp_path / "inst.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>[INST] ' + m['content'] | trim + "
        "' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
    )
    as_json = tmp_path / "inst.json"
    run_cli(
        "composite.chat_template",
        str(template),
        "--artifacts",
        str(chat_gguf_export),
        "--output",
        str(as_json),
        check=True,
    )
    chat = json.loads(as_json.read_text())
    assert chat["system_prefix"] is None and chat["first_user_prefix"] == "<|im_start|>[INST] "
    assert chat["user_prefix"] == "<|im_start|>[INST] " and chat["trim"] == ["user"]
    prompts = []
    for runner, flag in (("cpp", as_json), ("python", as_json), ("python", template)):
        result = run_chat(runner, chat_gguf_export, tmp_path / "o.json", "--chat_template", str(flag), system=None)
        assert result.returncode == 0, result.stderr
        prompts.append([t["prompt"] for t in json.loads((tmp_path / "o.json").read_text())["turns"]])
    assert prompts[0] == prompts[1] == prompts[2]
    ours = Tokenizer(chat_gguf_export / "tokenizer.json")
    assert prompts[0][0] == ours.encode(f"<|im_start|>[INST] {TURNS[0]} [/INST]", bos=False)
    # A system message with a template that has no system role: one line, both runners.
    for runner in ("cpp", "python"):
        result = run_chat(runner, chat_gguf_export, tmp_path / "s.json", "--chat_template", str(as_json))
        assert result.returncode == 2 and "has no system role" in result.stderr, result.stderr
    # composite_runner renders no Jinja, and says how to convert it.
    result = run_chat("cpp", chat_gguf_export, tmp_path / "j.json", "--chat_template", str(template), system=None)
    assert result.returncode == 2 and "composite.chat_template" in result.stderr


def test_the_export_notes_that_the_weights_were_quantized(chat_gguf):
    from composite.model.gguf_file import read_gguf

    _, folder, _ = chat_gguf
    notes = read_gguf(folder / GGUF_NAME).notes
    assert len(notes) == 1 and "already quantized (" in notes[0] and "Q8_0 " in notes[0] and "F16 " in notes[0]


@pytest.fixture(scope="session")
def sentencepiece_gguf(workdir):
    """The embedded default model with tied embeddings and a Llama-2-style SentencePiece vocabulary,
    as an F32 GGUF, as llama.cpp converts Llama 2."""
    import sentencepiece

    # Normalized as Llama 2's is: a GGUF's vocabulary carries no normalizer.
    tokenizer_path = workdir / "llama2_style.model"
    tokenizer_path.write_bytes(train_sentencepiece(corpus_text(), 512, identity_normalization=True))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    tokens = [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    types = [
        3 if sp.IsControl(i) else 2 if sp.IsUnknown(i) else 6 if sp.IsByte(i) else 1 for i in range(sp.vocab_size())
    ]
    scores = [sp.GetScore(i) for i in range(sp.vocab_size())]
    model = default_model()
    with torch.no_grad():
        model.output.weight.copy_(model.tok_embeddings.weight)  # tied, as the GGUF will say
    args = model.args
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        max_position_embeddings=MAX_SEQ_LEN,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    names = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm"}
    inner = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w2": "mlp.down_proj",
        "feed_forward.w3": "mlp.up_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    state = {}
    for key, value in model.state_dict().items():
        module = key.removesuffix(".weight")
        if module == "output":
            continue
        if module in names:
            state[f"{names[module]}.weight"] = value
        else:
            _, layer, rest = module.split(".", 2)
            state[f"model.layers.{layer}.{inner[rest]}.weight"] = value
    hf.load_state_dict(state, strict=False)
    path = workdir / "sentencepiece.gguf"
    write_llama_gguf(
        path,
        hf,
        tokens,
        types,
        None,
        tokenizer_model="llama",
        scores=scores,
        bos_id=sp.bos_id(),
        eos_id=sp.eos_id(),
        float_type=np.float32,
    )
    return path, model, tokenizer_path


def test_sentencepiece_gguf_gives_the_model_and_tokenizer_it_was_written_from(sentencepiece_gguf):
    from composite.model.checkpoint import load_checkpoint

    path, model, tokenizer_path = sentencepiece_gguf
    loaded = load_checkpoint(str(path), None)
    assert loaded.model.args.tie_embeddings and loaded.tokenizer_path.name == "tokenizer.model"
    tokens = torch.tensor([[1, 40, 300, 7, 99, 12, 250, 3]])
    with torch.no_grad():
        ours, expected = loaded.model.forward_full(tokens), model.forward_full(tokens)
    assert (ours - expected).abs().max().item() < 1e-5
    original, rebuilt = Tokenizer(tokenizer_path), Tokenizer(loaded.tokenizer_path)
    assert rebuilt.bos_id == original.bos_id and rebuilt.eos_ids == original.eos_ids
    for text in [*TEXTS, " leading space", "", "\u00e9t\u00e9 2024"]:
        assert rebuilt.encode(text) == original.encode(text), text


def test_bad_gguf_files_are_refused_in_one_line(chat_gguf, tmp_path):
    _, folder, _ = chat_gguf
    good = folder / GGUF_NAME
    tok = train_byte_level_bpe(corpus_text(), 300, CHATML_SPECIALS)
    tokens, types, merges = vocabulary(tok)
    small = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokens),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    )
    cases = {
        "gemma.gguf": ("holds a 'gemma' model", "only the llama architecture"),
        "qwen_pre.gguf": ("pre-tokenizer 'qwen2' is not supported",),
        "truncated.gguf": ("is truncated",),
        "not_gguf.gguf": ("is not a GGUF file",),
    }
    write_llama_gguf(tmp_path / "gemma.gguf", small, tokens, types, merges, architecture="gemma")
    write_llama_gguf(tmp_path / "qwen_pre.gguf", small, tokens, types, merges, pre="qwen2")
    data = good.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    (tmp_path / "not_gguf.gguf").write_bytes(b"this is not a model\n" * 10)
    for name, phrases in cases.items():
        out = tmp_path / f"out_{name}"
        result = run_cli("composite.export", "--checkpoint", str(tmp_path / name), "--output", str(out))
        assert_clean_failure(result, *phrases, output=out)
    # A template the runners cannot reproduce: the assistant's turn closes with text, no special token.
    plain = tmp_path / "plain.jinja"
    plain.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    out = tmp_path / "out_template"
    result = run_cli("composite.export", "--checkpoint", str(good), "--chat-template", str(plain), "--output", str(out))
    assert_clean_failure(result, "chat template", "no special token", output=out)
