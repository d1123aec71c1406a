"""Shared fixtures: tiny models and their exports, each made once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from composite import quiet

quiet.silence_library_noise()
# Every export in the tests lowers its shards (tests/test_shard_cache.py turns the cache on for itself).
os.environ["COMPOSITE_CACHE"] = "off"

from composite.config import build_config  # noqa: E402
from composite.errors import UserError  # noqa: E402
from composite.export import run_export  # noqa: E402
from composite.model.llama import ModelArgs, Transformer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# The host runner every test runs (scripts/build_runner.sh builds it); COMPOSITE_BUILD_DIR points
# the tests at another build, e.g. the sanitizer one.
RUNNER = Path(os.environ.get("COMPOSITE_BUILD_DIR", REPO / "build")) / "composite_runner"
FP16_PLACEMENT = ["xnnpack", "qnn", "qnn", "qnn", "qnn", "xnnpack"]
SHARD_COUNTS = (1, 2, 3, 6)
PREFILL_LEN = 12  # a 32-token prompt then takes two full chunks and one padded chunk
MAX_SEQ_LEN = 96

# Llama 3 style: grouped-query attention, rope_theta 500000 with Llama 3 scaling, tied embeddings,
# 5 layers (not divisible by 2, 3 or 6).
LLAMA3_PARAMS = {
    "dim": 64,
    "n_layers": 5,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 300,
    "multiple_of": 32,
    "ffn_dim_multiplier": 1.3,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "use_scaled_rope": True,
}


def export(output: Path, **overrides) -> Path:
    """An export for this host: QNN shards without weight sharing (the x86 simulator cannot load it)."""
    values = {
        "max_seq_len": MAX_SEQ_LEN,
        "prefill_len": PREFILL_LEN,
        "output": str(output),
        "qnn": {"weight_sharing": False},
        **overrides,
    }
    return run_export(build_config(None, values))


def run_cli(
    module: str, *args: str, check: bool = False, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """python -m `module` *args from `cwd` (the repository by default), output captured."""
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{module} {args} failed ({result.returncode}):\n{result.stderr}")
    return result


def prompt_tokens_in_both_runners(export: Path, prompt: str, *flags: str) -> int:
    """How many tokens composite_runner and composite.run make of `prompt` (their stats'
    prompt_tokens), asserted equal."""
    counts = []
    args = ["--artifacts", str(export), "--prompt", prompt, "--max_new_tokens", "1", *flags]
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.json"
        result = subprocess.run([str(RUNNER), *args, "--stats_json", str(stats)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        counts.append(json.loads(stats.read_text())["prompt_tokens"])
    counts.append(json.loads(run_cli("composite.run", *args, "--json", check=True).stdout)["prompt_tokens"])
    assert counts[0] == counts[1], counts
    return counts[0]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """Exit 2 with exactly one `error:` line, and no traceback or crash; returns that line."""
    assert result.returncode == 2, (result.returncode, result.stdout + result.stderr)
    for crash in ("Traceback", "Segmentation", "terminate called"):
        assert crash not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def assert_clean_failure(result: subprocess.CompletedProcess, *phrases: str, output: Path | None = None) -> None:
    """One `error:` line naming `phrases`, exit 2, no traceback; no export folder or staging left."""
    line = one_error_line(result)
    for phrase in phrases:
        assert phrase in line, line
    if output is not None:
        assert not output.exists()
        assert not list(output.parent.glob(f".{output.name}.partial-*"))


def rotate_half_to_meta(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of the loader's permutation: write weights the way Meta checkpoints store them."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_meta_checkpoint(folder: Path, params: dict, seed: int) -> Path:
    from composite.model.params import args_from_meta_params

    folder.mkdir(parents=True, exist_ok=True)
    args = args_from_meta_params(params, folder / "params.json")
    args = ModelArgs(**{**args.to_dict(), "tie_embeddings": True})
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(0.0, 1.0)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "output.weight"}
    for key in list(state):
        if key.endswith("attention.wq.weight"):
            state[key] = rotate_half_to_meta(state[key], args.n_heads)
        elif key.endswith("attention.wk.weight"):
            state[key] = rotate_half_to_meta(state[key], args.n_kv_heads)
    torch.save(state, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps(params))
    return folder / "consolidated.00.pth"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("composite")


@pytest.fixture(scope="session")
def default_exports(workdir) -> dict[int, Path]:
    return {n: export(workdir / f"default_{n}", shards=n) for n in SHARD_COUNTS}


@pytest.fixture(scope="session")
def default_8da4w_export(workdir) -> Path:
    return export(workdir / "default_3_8da4w", shards=3, xnnpack={"quantize": "8da4w", "group_size": 32})


@pytest.fixture(scope="session")
def llama3_checkpoint(workdir) -> Path:
    return write_meta_checkpoint(workdir / "llama3_ckpt", LLAMA3_PARAMS, seed=7)


@pytest.fixture(scope="session")
def llama3_exports(workdir, llama3_checkpoint) -> dict[int, Path]:
    return {n: export(workdir / f"llama3_{n}", shards=n, checkpoint=str(llama3_checkpoint)) for n in SHARD_COUNTS}


@pytest.fixture(scope="session")
def default_tokenizer(workdir) -> Path:
    from composite.model.default import load_default

    path = workdir / "default_tokenizer.model"
    path.write_bytes(load_default().tokenizer_path.read_bytes())
    return path


@pytest.fixture(scope="session")
def qnn_ready():
    from composite import qnn_host

    try:
        host = qnn_host.prepare()
    except UserError as e:
        reason = f"QNN host libraries unavailable: {e}"
    else:
        if qnn_host.is_active(host):
            return host
        reason = 'QNN host libraries are not on the loader path: run after eval "$(python -m composite.qnn_host env)"'
    if os.environ.get("COMPOSITE_REQUIRE_QNN") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def qnn_fp16_export(qnn_ready, workdir):
    return export(workdir / "qnn_fp16_6", shards=6, placement=FP16_PLACEMENT)
