"""composite_runner (C++) against composite.run, the eager reference, and the Python tokenizers."""

from __future__ import annotations

import base64
import itertools
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from composite.manifest import read
from composite.model.default import corpus_text
from composite.runtime.reference import generate_reference, reference_model
from composite.runtime.sampler import Sampler
from composite.tokenizer import Tokenizer
from conftest import RUNNER, one_error_line, prompt_tokens_in_both_runners, run_cli, runner_built

TOKENIZE = RUNNER.parent / "composite_tokenize"
NEW_TOKENS = 64

pytestmark = pytest.mark.usefixtures("needs_runner")

TEXTS = [
    "Once upon a time there was a little robot.",
    "  leading spaces, trailing space ",
    "naïve café, façade, smörgåsbord; crème brûlée",
    "emoji 🙂🚀 and CJK 日本語 and Ελληνικά",
    "numbers 12345 3.14159 1e-4 and tabs\tand\nnewlines\n\n",
    "byte fallback: ᚠᛇᚻ ⟁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "don't we'll I'M they've",
    "special tokens: <s>one</s> <unk> <|begin_of_text|>two<|eot_id|><|reserved_special_token_7|>",
]


def run_runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUNNER), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def six(default_exports) -> Path:
    return default_exports[6]


def runner_stats(folder: Path, stats: Path, *args: str) -> dict:
    """composite_runner on `folder` with `args`; its --stats_json, after a clean exit."""
    result = run_runner("--artifacts", str(folder), *args, "--stats_json", str(stats))
    assert result.returncode == 0, result.stderr
    return json.loads(stats.read_text())


def python_tokens(folder: Path, *args: str) -> list[int]:
    """composite.run on `folder` with `args`: the tokens of its --json stats."""
    return json.loads(run_cli("composite.run", "--artifacts", str(folder), *args, "--json", check=True).stdout)[
        "tokens"
    ]


def runner_tokens(folder: Path, tmp_path: Path, *prompt_args: str) -> list[int]:
    stats = tmp_path / "stats.json"
    result = run_runner(
        "--artifacts", str(folder), *prompt_args, "--max_new_tokens", str(NEW_TOKENS), "--stats_json", str(stats)
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(stats.read_text())
    assert len(data["shard_ms_per_token"]) == len(read(folder)["shards"])
    assert data["peak_rss_mb"] > 0 and data["decode_tokens_per_s"] > 0
    return data["tokens"]


@pytest.mark.parametrize("style", ["prompt", "prompt_ids"])
def test_greedy_tokens_match_python_and_eager(six, tmp_path, style):
    manifest = read(six)
    tokenizer = Tokenizer(six / "tokenizer.model")
    text = "The robot climbed the stairs and"
    ids = tokenizer.encode(text)
    args = ("--prompt", text) if style == "prompt" else ("--prompt_ids", ",".join(map(str, ids)))
    ours = runner_tokens(six, tmp_path, *args)
    python = run_cli(
        "composite.run",
        "--artifacts",
        str(six),
        "--" + style.replace("_", "-"),
        args[1],
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--json",
        check=True,
    )
    assert ours == json.loads(python.stdout)["tokens"]
    eager = generate_reference(reference_model(manifest), ids, NEW_TOKENS, manifest["max_seq_len"], Sampler())
    assert ours == eager.tokens
    assert len(ours) == NEW_TOKENS


def test_sampling_is_seeded(six, tmp_path):
    def sample(seed):
        stats = tmp_path / f"s{seed}.json"
        result = run_runner(
            "--artifacts",
            str(six),
            "--prompt",
            "Mia ran",
            "--max_new_tokens",
            "16",
            "--temperature",
            "0.9",
            "--top_p",
            "0.9",
            "--seed",
            str(seed),
            "--stats_json",
            str(stats),
        )
        assert result.returncode == 0, result.stderr
        return json.loads(stats.read_text())["tokens"]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def tiktoken_ranks(path: Path) -> None:
    """A small byte-level BPE learned from the package corpus, written as a tiktoken ranks file."""
    words = Counter(corpus_text().replace("\n", " ").split(" "))
    vocab = [bytes([b]) for b in range(256)]
    pieces = {tuple(bytes([b]) for b in (" " + w).encode()): n for w, n in words.items() if w}
    for _ in range(200):
        pairs = Counter()
        for word, n in pieces.items():
            for a, b in itertools.pairwise(word):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        vocab.append(a + b)
        merged = {}
        for word, n in pieces.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = n
        pieces = merged
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(vocab)))


@pytest.mark.parametrize("special_as_text", [False, True])
@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_cpp_tokenizers_equal_python(tmp_path, default_tokenizer, kind, special_as_text):
    if not runner_built(TOKENIZE):
        pytest.skip(f"{TOKENIZE} not built (scripts/build_runner.sh)")
    if kind == "tiktoken":
        path = tmp_path / "ranks.tiktoken"
        tiktoken_ranks(path)
    else:
        path = default_tokenizer
    python = Tokenizer(path, kind)
    flags = ["--special-as-text"] if special_as_text else []
    result = subprocess.run(
        [str(TOKENIZE), kind, str(path), *flags], input=json.dumps(TEXTS), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for text, cpp in zip(TEXTS, json.loads(result.stdout)):
        expected = python.encode(text, parse_special=not special_as_text)
        assert cpp["ids"] == expected, text
        decoded = python.decode(expected[1:])
        if kind == "sentencepiece" and "<s>" in text:
            # After a control token mid-text, SentencePiece's whole-sequence decode keeps the word's
            # space; streaming (both runners) drops it, as after BOS.
            continue
        assert cpp["text"] == decoded or cpp["text"] == text, (text, cpp["text"], decoded)
    special = python.specials["</s>" if kind == "sentencepiece" else "<|eot_id|>"]
    assert (special in json.loads(result.stdout)[-1]["ids"]) is not special_as_text


def test_special_tokens_in_a_sentencepiece_prompt(six):
    python = Tokenizer(six / "tokenizer.model")
    prompt = "The end.</s><s>Once"
    # Each text piece is encoded on its own, as Meta's Llama 2 chat code encodes each turn.
    parsed = python.encode("The end.") + [2, 1] + python.encode("Once", bos=False)
    assert python.encode(prompt) == parsed
    assert prompt_tokens_in_both_runners(six, prompt) == len(parsed)
    as_text = python.encode(prompt, parse_special=False)
    assert 1 not in as_text[1:] and 2 not in as_text
    assert prompt_tokens_in_both_runners(six, prompt, "--special_as_text") == len(as_text)


def copy_export(folder: Path, target: Path) -> Path:
    target.mkdir()
    for f in folder.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def test_bad_input(six, default_exports, tmp_path):
    assert "does not exist" in one_error_line(run_runner("--artifacts", str(tmp_path / "nope"), "--prompt", "hi"))
    assert "unknown flag '--frobnicate'" in one_error_line(
        run_runner("--artifacts", str(six), "--frobnicate", "1", "--prompt", "x")
    )
    assert "max_seq_len" in one_error_line(run_runner("--artifacts", str(six), "--prompt", "word " * 300))
    # A limit beyond the context is one only without a context shift, which goes on past it.
    walled = ("--prompt", "hi", "--seq_len", "100000", "--no_context_shift")
    assert "beyond" in one_error_line(run_runner("--artifacts", str(six), *walled))
    assert "empty" in one_error_line(run_runner("--artifacts", str(six), "--prompt", ""))
    bad_utf8 = tmp_path / "bad.txt"
    bad_utf8.write_bytes(b"caf\xe9 \xff")
    assert "UTF-8" in one_error_line(run_runner("--artifacts", str(six), "--prompt_file", str(bad_utf8)))

    missing = copy_export(six, tmp_path / "missing")
    (missing / "shard_03.pte").unlink()
    assert "shard 3" in one_error_line(run_runner("--artifacts", str(missing), "--prompt", "hi"))

    truncated = copy_export(six, tmp_path / "truncated")
    shard = truncated / "shard_02.pte"
    shard.write_bytes(shard.read_bytes()[:4096])
    assert "truncated" in one_error_line(run_runner("--artifacts", str(truncated), "--prompt", "hi"))

    # Same position, another export's file: sizes differ here, and --verify catches equal sizes by hash.
    swapped = copy_export(six, tmp_path / "swapped")
    (swapped / "shard_01.pte").write_bytes((default_exports[3] / "shard_01.pte").read_bytes())
    assert "shard 1" in one_error_line(run_runner("--artifacts", str(swapped), "--prompt", "hi", "--verify"))
    reordered = copy_export(six, tmp_path / "reordered")
    a, b = (reordered / "shard_02.pte").read_bytes(), (reordered / "shard_03.pte").read_bytes()
    (reordered / "shard_02.pte").write_bytes(b)
    (reordered / "shard_03.pte").write_bytes(a)
    assert "sha256" in one_error_line(run_runner("--artifacts", str(reordered), "--prompt", "hi", "--verify"))

    malformed = copy_export(six, tmp_path / "malformed")
    (malformed / "manifest.json").write_text('{"format": "composite-manifest", ')
    assert "malformed JSON" in one_error_line(run_runner("--artifacts", str(malformed), "--prompt", "hi"))

    wrong_shape = copy_export(six, tmp_path / "wrong_shape")
    manifest = json.loads((wrong_shape / "manifest.json").read_text())
    manifest["shards"][4]["io"]["decode"]["outputs"][0]["shape"] = [1, 1, 999]
    (wrong_shape / "manifest.json").write_text(json.dumps(manifest))
    line = one_error_line(run_runner("--artifacts", str(wrong_shape), "--prompt", "hi"))
    assert "shard 4" in line and "hidden" in line

    no_tokenizer = copy_export(six, tmp_path / "no_tokenizer")
    (no_tokenizer / "tokenizer.model").unlink()
    assert "tokenizer" in one_error_line(run_runner("--artifacts", str(no_tokenizer), "--prompt", "hi"))


@pytest.mark.parametrize("seq_len", [9, 12])  # this prompt reaches EOS at 13
def test_seq_len_counts_every_token_in_both_runners(default_exports, tmp_path, seq_len):
    folder = default_exports[3]
    prompt = [1, 450, 298, 17, 99, 3]
    ids = ",".join(map(str, prompt))
    data = runner_stats(folder, tmp_path / "stats.json", "--prompt_ids", ids, "--seq_len", str(seq_len))
    assert len(prompt) + len(data["tokens"]) == seq_len and data["stop_reason"] == "seq_len"
    assert python_tokens(folder, "--prompt-ids", ids, "--seq-len", str(seq_len)) == data["tokens"]


def test_manifest_with_an_exact_sqnr_loads_in_both_runners(default_exports, tmp_path):
    from composite import manifest_write

    folder = copy_export(default_exports[3], tmp_path / "exact")
    manifest = read(folder)
    manifest["shards"][1]["sqnr_db"] = {"decode": {"hidden": float("inf")}, "prefill": {"hidden": 41.5}}
    manifest_write.write(folder, manifest)
    text = (folder / "manifest.json").read_text()
    assert "Infinity" not in text
    assert read(folder)["shards"][1]["sqnr_db"]["decode"]["hidden"] is None
    cpp = run_runner("--artifacts", str(folder), "--prompt", "hi", "--max_new_tokens", "4")
    assert cpp.returncode == 0, cpp.stderr
    python = run_cli("composite.run", "--artifacts", str(folder), "--prompt", "hi", "--max-new-tokens", "4", "--json")
    assert python.returncode == 0, python.stderr


def test_portable_shard_generates_the_eager_tokens_in_both_runners(workdir, tmp_path):
    """A shard left to ExecuTorch's portable/optimized CPU kernels (no delegate) between two
    XNNPACK shards."""
    from conftest import export

    folder = export(workdir / "portable_3", shards=3, placement=["xnnpack", "portable", "xnnpack"])
    manifest = read(folder)
    assert manifest["shards"][1]["backends"] == [] and manifest["shards"][1]["cpu_ops"]["decode"]
    ids = Tokenizer(folder / "tokenizer.model").encode("The robot climbed the stairs and")
    data = runner_stats(
        folder, tmp_path / "stats.json", "--prompt_ids", ",".join(map(str, ids)), "--max_new_tokens", "24"
    )
    assert data["shard_backends"][1] == "portable"
    python = python_tokens(folder, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "24")
    eager = generate_reference(
        reference_model(manifest), ids, 24, manifest["max_seq_len"], Sampler(), tuple(manifest["eos_ids"])
    )
    assert data["tokens"] == python == eager.tokens


def test_both_runners_write_one_stats_schema_that_the_report_reads(six, tmp_path):
    cpp_stats, python_stats = tmp_path / "cpp.json", tmp_path / "python.json"
    runner_stats(six, cpp_stats, "--prompt", "Mia ran", "--max_new_tokens", "6")
    run_cli(
        "composite.run",
        "--artifacts",
        str(six),
        "--prompt",
        "Mia ran",
        "--max-new-tokens",
        "6",
        "--stats-json",
        str(python_stats),
        check=True,
    )
    ours, theirs = json.loads(cpp_stats.read_text()), json.loads(python_stats.read_text())
    assert set(theirs) - set(ours) == {"text"} and set(ours) <= set(theirs)
    for key in ("tokens", "prompt_tokens", "stop_reason", "prefill_width", "shard_backends", "shard_layers"):
        assert ours[key] == theirs[key], key
    assert len(theirs["shard_ms_per_token"]) == len(theirs["prefill_shard_ms_per_token"]) == 6
    # Memory figures, from the manifest: K and V of every layer in float32, per shard by its layers.
    manifest = json.loads((six / "manifest.json").read_text())
    model, max_seq_len = manifest["model"], manifest["max_seq_len"]
    per_layer = 2 * model["n_kv_heads"] * model["head_dim"] * max_seq_len * 4
    layers = [end - first for first, end in (s["layers"] for s in manifest["shards"])]
    for stats in (ours, theirs):
        assert stats["kv_cache_bytes"] == model["n_layers"] * per_layer
        assert stats["kv_cache_bytes_per_shard"] == [n * per_layer for n in layers]
        assert stats["decode_io_bytes_per_shard"] == ours["decode_io_bytes_per_shard"]
    middle = ours["decode_io_bytes_per_shard"][1]  # hidden, input_pos, mask, caches in; hidden, new entries out
    dim, kv_row = model["dim"], model["n_kv_heads"] * model["head_dim"]
    assert middle["in"] == dim * 4 + 8 + (max_seq_len + 1) * 4 + layers[1] * per_layer
    assert middle["out"] == dim * 4 + layers[1] * 2 * kv_row * 4
    report = run_cli("composite.report", str(cpp_stats), str(python_stats), "--png", str(tmp_path / "r.png"))
    assert report.returncode == 0, report.stderr
    assert report.stdout.count("**total**") == 2
