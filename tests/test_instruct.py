"""An Instruct-style Hugging Face folder with only tokenizer.json (byte-level BPE, Llama 3 special
tokens, a chat template, generation_config.json's stop list): its ids equal `tokenizers`', its
greedy tokens equal transformers', and --chat builds the conversation apply_chat_template builds,
in both runners."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from composite.chat_template import conversation as chat_messages
from composite.model.default import corpus_text
from composite.tokenizer import Tokenizer
from conftest import (
    RUNNER,
    assert_clean_failure,
    export,
    one_error_line,
    prompt_tokens_in_both_runners,
    run_cli,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
]
# Llama 3 Instruct's template, as its tokenizer_config.json carries it.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT_SEQ_LEN = 160  # three turns of chat
SYSTEM = "You are a terse robot."
TURNS = ["Tell me about the little robot.", "  And then?  ", "Why?"]
TEXTS = [
    "Once upon a time there was a little robot.",
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
    "naïve café, façade; crème brûlée",
    "emoji 🙂🚀 and CJK 日本語 한국어",
    "runs   of\t\twhitespace  \n\n\n  end  ",
    "a<|eot_id|>b <|eom_id|><|begin_of_text|>",
]

pytestmark = pytest.mark.usefixtures("needs_runner")


def train_tokenizer(folder: Path) -> tokenizers.Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    tok.add_special_tokens(SPECIALS)  # after the merges, as in Llama 3
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
        ]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return tok


@pytest.fixture(scope="session")
def instruct_folder(workdir):
    """The model ends its first answer with <|eot_id|>: that token's head row is a copy, a little
    larger, of the row of the third token greedy decoding would otherwise give."""
    folder = workdir / "instruct"
    folder.mkdir()
    tok = train_tokenizer(folder)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CHAT_SEQ_LEN,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|end_of_text|>"],
    )
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        first = template_ids(folder, messages(TURNS[0]))
        greedy = model.generate(torch.tensor([first]), max_new_tokens=3, do_sample=False)[0, len(first) :]
        head = model.lm_head.weight
        head[ids["<|eot_id|>"]] = head[int(greedy[2])] * 1.05
    model.save_pretrained(folder)
    stops = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": stops, "do_sample": False})
    )
    return model, folder, ids


def hf_tokenizer_of(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_greedy(model, folder: Path, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate(), stopping where generation_config.json says."""
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops)
    return out[0, len(ids) :].tolist()


def template_ids(folder: Path, conversation: list[dict]) -> list[int]:
    """transformers' apply_chat_template, tokenized, with the assistant header to follow."""
    encoding = hf_tokenizer_of(folder).apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)
    return list(encoding["input_ids"])


def messages(*turns: str, answers: tuple[str, ...] = ()) -> list[dict]:
    return chat_messages(SYSTEM, list(turns), list(answers))


@pytest.fixture(scope="session")
def instruct_export(workdir, instruct_folder):
    _, folder, _ = instruct_folder
    return export(workdir / "instruct_export", shards=2, checkpoint=str(folder), max_seq_len=CHAT_SEQ_LEN)


def test_manifest_records_the_tokenizer_stops_and_chat_template(instruct_export, instruct_folder):
    _, folder, ids = instruct_folder
    manifest = json.loads((instruct_export / "manifest.json").read_text())
    assert manifest["tokenizer"]["type"] == "hf_json"
    assert manifest["bos_id"] == ids["<|begin_of_text|>"]
    # config.json names one eos; generation_config.json the three Llama 3 Instruct stops.
    assert manifest["eos_ids"] == sorted([ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]])
    # The template of tokenizer_config.json, as text around each message.
    assert manifest["chat"] == {
        "source": f"{folder / 'tokenizer_config.json'} chat_template",
        "system_prefix": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
        "system_suffix": "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",
        "first_user_prefix": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
        "user_suffix": "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "end_of_turn_id": ids["<|eot_id|>"],
        "user_prefix": "<|start_header_id|>user<|end_header_id|>\n\n",
        "trim": ["system", "user"],
    }


@pytest.mark.parametrize("special_as_text", [False, True])
def test_ids_equal_tokenizers(instruct_folder, special_as_text):
    _, folder, _ = instruct_folder
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference.encode_special_tokens = special_as_text
    python = Tokenizer(folder / "tokenizer.json")
    tool = RUNNER.parent / "composite_tokenize"
    result = subprocess.run(
        [str(tool), "hf_json", str(folder / "tokenizer.json"), *(["--special-as-text"] if special_as_text else [])],
        input=json.dumps(TEXTS),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    for text, cpp in zip(TEXTS, json.loads(result.stdout)):
        expected = reference.encode(text).ids  # with the post-processor's BOS
        assert python.encode(text, parse_special=not special_as_text) == expected, text
        assert cpp["ids"] == expected, text
        assert cpp["text"] == reference.decode(expected), text
    eot_in_text = TEXTS[-1]
    eot = reference.token_to_id("<|eot_id|>")
    assert (eot in reference.encode(eot_in_text).ids) is not special_as_text


def test_special_tokens_in_a_prompt_are_one_id_unless_asked(instruct_export, instruct_folder):
    _, folder, _ = instruct_folder
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = "The end<|eot_id|>"
    assert prompt_tokens_in_both_runners(instruct_export, prompt) == len(reference.encode(prompt).ids)
    reference.encode_special_tokens = True
    as_text = prompt_tokens_in_both_runners(instruct_export, prompt, "--special_as_text")
    assert as_text == len(reference.encode(prompt).ids) > len(reference.encode("The end").ids) + 1


def test_greedy_tokens_equal_transformers(instruct_export, instruct_folder):
    model, folder, _ = instruct_folder
    prompt = "Once upon a time, the robot"
    stats = instruct_export.parent / "instruct_greedy.json"
    result = subprocess.run(
        [str(RUNNER), "--artifacts", str(instruct_export), "--prompt", prompt, "--max_new_tokens", "16"]
        + ["--stats_json", str(stats)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    ours = json.loads(stats.read_text())["tokens"]
    assert ours == hf_greedy(model, folder, hf_tokenizer_of(folder)(prompt)["input_ids"], 16)


def run_chat(runner: str, export: Path, stats: Path, *flags: str, turns=TURNS) -> subprocess.CompletedProcess:
    args = ["--artifacts", str(export), "--chat", "--system", SYSTEM, "--max_new_tokens", "8"]
    args += ["--stats_json", str(stats), *flags]
    stdin = "\n".join(turns) + "\n"
    if runner == "cpp":
        return subprocess.run([str(RUNNER), *args], input=stdin, capture_output=True, text=True)
    return subprocess.run(
        ["python", "-m", "composite.run", *args], input=stdin, capture_output=True, text=True, cwd=RUNNER.parent.parent
    )


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_chat_builds_the_conversation_apply_chat_template_builds(instruct_export, instruct_folder, runner, tmp_path):
    """Three turns with a system message. The template renders an answer as text; with empty
    answers, the tokens around them are the template's own, and each answer's tokens are the
    model's (what it generated, not re-encoded)."""
    model, folder, ids = instruct_folder
    result = run_chat(runner, instruct_export, tmp_path / "chat.json")
    assert result.returncode == 0, result.stderr
    turns = json.loads((tmp_path / "chat.json").read_text())["turns"]
    assert len(turns) == 3
    # Turn 1 is the template's opening, up to the assistant header, and its answer ends the
    # assistant's turn itself.
    assert turns[0]["start_pos"] == 0 and turns[0]["prompt"] == template_ids(folder, messages(TURNS[0]))
    assert turns[0]["stop_reason"] == "eos" and turns[0]["tokens"][-1] == ids["<|eot_id|>"]
    context, cache = [], []  # the cache's tokens without and with the answers
    for k, turn in enumerate(turns):
        assert turn["start_pos"] == len(cache) and turn["prompt_tokens"] == len(turn["prompt"])
        # Later turns prefill only their own tokens: the end of the answer before, then the
        # template's next user turn.
        carried = [] if k == 0 or turns[k - 1]["stop_reason"] == "eos" else turns[k - 1]["tokens"][-1:]
        assert turn["prompt"][: len(carried)] == carried
        context += turn["prompt"][len(carried) :]
        assert context == template_ids(folder, messages(*TURNS[: k + 1], answers=("",) * k)), f"turn {k + 1}"
        cache += turn["prompt"]
        # Each answer is transformers' greedy continuation of the same context.
        assert turn["tokens"] == hf_greedy(model, folder, cache, 8), f"turn {k + 1}"
        cache += turn["tokens"][:-1]
    assert turns[1]["prompt"][0] == ids["<|eot_id|>"]


def test_both_runners_chat_alike(instruct_export, tmp_path):
    outputs = {}
    for runner in ("cpp", "python"):
        result = run_chat(runner, instruct_export, tmp_path / f"{runner}.json")
        assert result.returncode == 0, result.stderr
        turns = json.loads((tmp_path / f"{runner}.json").read_text())["turns"]
        outputs[runner] = ([(t["prompt"], t["tokens"], t["stop_reason"]) for t in turns], result.stdout)
    assert outputs["cpp"] == outputs["python"]
    assert outputs["cpp"][1].count("\n") == len(TURNS)  # one line of answer per turn


def test_a_long_chat_goes_on_past_the_context_alike_in_both_runners(instruct_export, tmp_path):
    """Twelve turns of ~25 tokens each in a context of 160: the oldest turns are evicted (the first
    4 tokens kept) and every turn is answered, the same in both runners."""
    outputs = {}
    for runner in ("cpp", "python"):
        result = run_chat(runner, instruct_export, tmp_path / f"{runner}.json", turns=TURNS * 4)
        assert result.returncode == 0, result.stderr
        stats = json.loads((tmp_path / f"{runner}.json").read_text())
        assert len(stats["turns"]) == 12 and stats["chat_context_shifts"] >= 2, stats["chat_context_shifts"]
        assert all(turn["start_pos"] < CHAT_SEQ_LEN for turn in stats["turns"])
        outputs[runner] = [(t["prompt"], t["tokens"], t["start_pos"]) for t in stats["turns"]], result.stdout
    assert outputs["cpp"] == outputs["python"]


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_a_turn_longer_than_the_context_ends_the_chat_cleanly(instruct_export, runner, tmp_path):
    result = run_chat(runner, instruct_export, tmp_path / "long.json", turns=[TURNS[0], "robot " * 200])
    assert result.returncode == 0, result.stderr
    assert "this turn has" in result.stderr and "the chat ends here" in result.stderr
    assert len(json.loads((tmp_path / "long.json").read_text())["turns"]) == 1


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_chat_ends_cleanly_when_the_context_is_full(instruct_export, instruct_folder, runner, tmp_path):
    _, folder, _ = instruct_folder
    opening = template_ids(folder, messages(TURNS[0]))
    # Room for the first turn and 3 answer tokens; the second turn cannot fit.
    result = run_chat(runner, instruct_export, tmp_path / "full.json", "--seq_len", str(len(opening) + 3))
    assert result.returncode == 0, result.stderr
    assert "the context is full" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_chat_flag_errors(instruct_export, default_exports, runner, tmp_path):
    def run(*args):
        if runner == "cpp":
            return subprocess.run([str(RUNNER), *args], capture_output=True, text=True, input="")
        return run_cli("composite.run", *args)

    export = str(instruct_export)
    assert "--system is for --chat" in one_error_line(run("--artifacts", export, "--prompt", "x", "--system", "s"))
    both = run("--artifacts", export, "--chat", "--prompt", "x")  # composite.run: argparse's own line
    assert both.returncode == 2 and "--chat" in both.stderr.strip().splitlines()[-1], both.stderr
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in default_exports[3].iterdir():
        (no_tokenizer / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((no_tokenizer / "manifest.json").read_text())
    manifest["chat"] = None
    (no_tokenizer / "manifest.json").write_text(json.dumps(manifest))
    assert "no chat template" in one_error_line(run("--artifacts", str(no_tokenizer), "--chat"))


def test_unsupported_tokenizer_json_is_refused_at_export(instruct_folder, workdir, tmp_path):
    from tokenizers import models

    _, folder, _ = instruct_folder
    wordpiece = tmp_path / "wordpiece.json"
    tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(wordpiece))
    out = tmp_path / "out"
    result = run_cli(
        "composite.export", "--checkpoint", str(folder), "--tokenizer", str(wordpiece), "--output", str(out)
    )
    assert_clean_failure(result, "model type WordPiece", "byte-level BPE", output=out)


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_an_answer_cut_short_keeps_its_last_token(instruct_export, instruct_folder, runner, tmp_path):
    """One new token per turn: the answer's token was sampled but never run, so the next turn
    prefills it before closing the assistant's turn."""
    _, _, ids = instruct_folder
    result = run_chat(runner, instruct_export, tmp_path / "short.json", "--max_new_tokens", "1")
    assert result.returncode == 0, result.stderr
    first, second, _ = json.loads((tmp_path / "short.json").read_text())["turns"]
    assert first["stop_reason"] == "max_new_tokens" and len(first["tokens"]) == 1
    assert second["start_pos"] == len(first["prompt"])
    assert second["prompt"][:2] == [first["tokens"][0], ids["<|eot_id|>"]]
