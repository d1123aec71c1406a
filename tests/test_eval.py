"""composite.eval and composite_runner --eval_text on the tiny default: perplexity equal to the
eager model's, KL divergence against eager and against a kld-base file, the same figures in both
runners, each shard's SQNR, and bad inputs refused in one line."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from composite import manifest as manifest_schema
from composite.eval.metrics import Reference
from composite.eval.scoring import chunks, eval_tokens
from composite.model.default import corpus_text, default_model
from composite.tokenizer import Tokenizer, train_sentencepiece
from conftest import DEBIAN_TEXT, MAX_SEQ_LEN, RUNNER, one_error_line, run_cli

# Real text from a Debian package: base-files ships the GNU GPL's text.
TEXT = DEBIAN_TEXT
CTX, LIMIT = 64, 400

pytestmark = pytest.mark.usefixtures("needs_debian_text")


def python_eval(export: Path, *flags: str) -> dict:
    args = ["--artifacts", str(export), "--text", str(TEXT), "--ctx", str(CTX), "--limit-tokens", str(LIMIT)]
    return json.loads(run_cli("composite.eval", *args, *flags, "--json", check=True).stdout)


def cpp_eval(export: Path, stats: Path, *flags: str) -> dict:
    args = ["--artifacts", str(export), "--eval_text", str(TEXT), "--ctx", str(CTX), "--limit_tokens", str(LIMIT)]
    result = subprocess.run([str(RUNNER), *args, *flags, "--stats_json", str(stats)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("perplexity ")
    return json.loads(stats.read_text())


def eager_perplexity(export: Path) -> float:
    """The eager float model's perplexity on the same chunks, computed here from its logits."""
    manifest = manifest_schema.read(export)
    tokenizer = Tokenizer(export / manifest["tokenizer"]["file"])
    pieces = chunks(eval_tokens(tokenizer, TEXT.read_text(), LIMIT), CTX, manifest["bos_id"])
    model = default_model()
    nll, count = 0.0, 0
    with torch.no_grad():
        for chunk in pieces:
            logp = torch.log_softmax(model.forward_full(torch.tensor([chunk]))[0].double(), dim=-1)
            nll -= sum(float(logp[p, chunk[p + 1]]) for p in range(CTX - 1))
            count += CTX - 1
    return math.exp(nll / count)


@pytest.fixture(scope="session")
def fp32_against_eager(default_exports):
    return python_eval(default_exports[3], "--reference", "eager", "--per-shard")


def test_fp32_export_is_the_eager_model(default_exports, fp32_against_eager):
    result = fp32_against_eager
    assert result["tokens"] == (LIMIT // CTX) * (CTX - 1)
    assert result["kld_mean"] < 1e-6 and result["kld_max"] < 1e-5
    assert result["top1_agreement"] == 1.0
    assert abs(result["perplexity"] / eager_perplexity(default_exports[3]) - 1) < 1e-5


def test_per_shard_lists_every_shard(default_exports, fp32_against_eager):
    shards = fp32_against_eager["shards"]
    assert [s["index"] for s in shards] == [0, 1, 2]
    assert all(s["sqnr_db"] > 80 and s["sqnr_worst_token_db"] > 80 for s in shards)


@pytest.fixture(scope="session")
def quantized_against_eager(default_8da4w_export, workdir):
    base = workdir / "eval_eager.kld"
    # k = the whole vocabulary: the file then holds the reference exactly, up to float32.
    vocab = manifest_schema.read(default_8da4w_export)["model"]["vocab_size"]
    flags = ("--reference", "eager", "--kld-base-out", str(base), "--k", str(vocab), "--per-shard")
    return python_eval(default_8da4w_export, *flags), base


def test_8da4w_export_diverges_and_both_runners_agree(default_8da4w_export, quantized_against_eager, tmp_path):
    eager, base = quantized_against_eager
    assert eager["kld_mean"] > 1e-4 and eager["top1_agreement"] < 1.0
    assert all(s["sqnr_db"] < 60 for s in eager["shards"])  # quantized layers, against float ones
    from_file = python_eval(default_8da4w_export, "--kld-base", str(base))
    cpp = cpp_eval(default_8da4w_export, tmp_path / "cpp.json", "--kld_base", str(base))
    for key in ("perplexity", "kld_mean", "kld_p90", "top1_agreement", "ppl_ratio", "rms_dp"):
        assert math.isclose(cpp[key], from_file[key], rel_tol=1e-4), key
    assert from_file["kld_mean"] == pytest.approx(eager["kld_mean"], rel=1e-4)
    assert from_file["perplexity"] == pytest.approx(eager["perplexity"], rel=1e-9)


def test_top_k_reference_bounds_the_exact_kld():
    """A reference kept as its top k tokens and one bin for the rest gives a lower bound of the
    exact KLD (the log-sum inequality), close to it when the top k hold nearly all the mass."""
    generator = torch.Generator().manual_seed(0)
    for temperature in (0.15, 3.0):  # a peaked distribution, then a flat one
        logp = torch.log_softmax(torch.randn(1000, generator=generator, dtype=torch.float64) / temperature, dim=0)
        logq = torch.log_softmax(logp + 0.3 * torch.randn(1000, generator=generator, dtype=torch.float64), dim=0)
        exact = Reference.full(logp, 0).kld(logq)
        top = torch.topk(logp, 64)
        rest = math.log(1 - float(torch.exp(top.values).sum()))
        truncated = Reference(float(logp[0]), int(top.indices[0]), top.indices, top.values, rest).kld(logq)
        assert 0 < truncated <= exact
        if temperature < 1:
            assert truncated / exact > 0.99


def test_both_runners_give_the_same_perplexity(default_exports, tmp_path):
    python = python_eval(default_exports[3], "--score", "second-half")
    cpp = cpp_eval(default_exports[3], tmp_path / "cpp.json", "--score", "second-half")
    assert cpp["tokens"] == python["tokens"] == (LIMIT // CTX) * (CTX - CTX // 2 - 1)
    assert math.isclose(cpp["perplexity"], python["perplexity"], rel_tol=1e-4)


def test_bad_inputs_are_refused_in_one_line(default_exports, llama3_exports, quantized_against_eager, tmp_path):
    export = str(default_exports[3])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    one = tmp_path / "one.txt"
    one.write_text("a")

    def both(folder: str, text: Path, *flags: str) -> tuple[str, str]:
        """The one error line of composite.eval and of composite_runner --eval_text."""
        python = run_cli("composite.eval", "--artifacts", folder, "--text", str(text), *flags)
        cpp_flags = [f.replace("--limit-tokens", "--limit_tokens").replace("--kld-base", "--kld_base") for f in flags]
        cpp = subprocess.run(
            [str(RUNNER), "--artifacts", folder, "--eval_text", str(text), *cpp_flags], capture_output=True, text=True
        )
        return one_error_line(python), one_error_line(cpp)

    for line in both(export, empty):
        assert "the evaluation text is empty" in line
    for line in both(export, one):
        assert "at least 2 are needed" in line
    for line in both(export, TEXT, "--ctx", str(MAX_SEQ_LEN + 1)):
        assert f"larger than this export's max_seq_len {MAX_SEQ_LEN}" in line
    other_model = run_cli(
        "composite.eval", "--artifacts", export, "--text", str(TEXT), "--reference", str(llama3_exports[3])
    )
    assert "is another model" in one_error_line(other_model)
    # The kld-base file of another text, and of the same text read by another tokenizer.
    _, base = quantized_against_eager
    flags = ("--ctx", str(CTX), "--limit-tokens", str(LIMIT), "--kld-base", str(base))
    other_text = tmp_path / "other.txt"
    other_text.write_text(TEXT.read_text().replace("software", "programs"))
    for line in both(export, other_text, *flags):
        assert "was written for another text" in line
    retokenized = tmp_path / "retokenized"
    retokenized.mkdir()
    for f in default_exports[3].iterdir():
        (retokenized / f.name).write_bytes(f.read_bytes())
    (retokenized / "tokenizer.model").write_bytes(train_sentencepiece(corpus_text(), 512, identity_normalization=True))
    for line in both(str(retokenized), TEXT, *flags):
        assert "was written for another tokenizer" in line
