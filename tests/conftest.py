"""Shared fixtures: tiny models and their exports, each made once per test session."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from composite import quiet

quiet.silence_library_noise()
# The tests share one cache of lowered shards per run (the `shard_cache` fixture names it; both
# xdist workers and every CLI a test starts use it): many exports have shards in common. Until the
# fixture has run, and for tests that must lower (determinism, a terminated export), it is off.
os.environ["COMPOSITE_CACHE"] = "off"

from composite.config import build_config  # noqa: E402
from composite.errors import UserError  # noqa: E402
from composite.export import run_export  # noqa: E402
from composite.model.llama import ModelArgs, Transformer  # noqa: E402
from composite.shard_cache import ShardCache  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# The host runner every test runs (scripts/build_runner.sh builds it); COMPOSITE_BUILD_DIR points
# the tests at another build, e.g. the sanitizer one.
RUNNER = Path(os.environ.get("COMPOSITE_BUILD_DIR", REPO / "build")) / "composite_runner"
FP16_PLACEMENT = ["xnnpack", "qnn", "qnn", "qnn", "qnn", "xnnpack"]
SHARD_COUNTS = (1, 3, 6)
# The Llama-3-style model's features (GQA, scaled RoPE, tied embeddings) do not depend on the cut.
LLAMA3_SHARD_COUNTS = (3,)
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


def export(output: Path, cached: bool = True, **overrides) -> Path:
    """An export for this host: QNN shards without weight sharing (the x86 simulator cannot load it);
    shards from the run's shard cache unless `cached` is false."""
    values = {
        "max_seq_len": MAX_SEQ_LEN,
        "prefill_len": PREFILL_LEN,
        "output": str(output),
        "qnn": {"weight_sharing": False},
        **overrides,
    }
    return run_export(build_config(None, values), ShardCache.from_environment() if cached else None)


def lower_here(loaded, config, index: int) -> bytes:
    """The .pte bytes of shard `index` of `config`, lowered in this process by the job an export
    runs for it (CPU shards: no calibration chain)."""
    from composite.executor.local import LocalExecutor
    from composite.lowering.jobs import lowering_jobs, shard_works
    from composite.split.plan import plan_shards

    specs = plan_shards(loaded.args, config.shards)
    jobs = lowering_jobs(shard_works(loaded, specs, config.placements(), config, None, None), [index])
    lowered = []
    LocalExecutor(0).run(jobs, lambda done: lowered.append(done.result.shard.buffer))
    return lowered[-1]


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


def runner_tokens(export: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens composite_runner generates, greedily, after `prompt_ids` (its stats' tokens)."""
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.json"
        args = ["--artifacts", str(export), "--prompt_ids", ",".join(map(str, prompt_ids))]
        args += ["--max_new_tokens", str(max_new_tokens), "--stats_json", str(stats)]
        result = subprocess.run([str(RUNNER), *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return json.loads(stats.read_text())["tokens"]


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
def workdir(tmp_path_factory, worker_id) -> Path:
    """One folder for the whole run: under pytest-xdist, shared by its workers (each session fixture
    that writes here is made by whichever worker needs it first: made_once)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    folder = root / "composite"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def shard_cache(workdir) -> Path:
    """The run's cache of lowered shards (the cache's own concurrency rules make sharing it
    between the two workers safe); scripts/test.sh names one its sanitizer check shares."""
    folder = Path(os.environ.get("COMPOSITE_TEST_SHARD_CACHE") or workdir / "run_shard_cache")
    os.environ["COMPOSITE_CACHE"] = str(folder)
    return folder


def made_once(path: Path, make) -> Path:
    """`path` (a file or folder), made by make(where) unless an earlier call, in any xdist worker,
    made it; the others wait for it. make writes elsewhere and `path` appears only when complete."""
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_name(f".{path.name}.partial")
            if partial.is_dir():
                shutil.rmtree(partial)
            partial.unlink(missing_ok=True)
            make(partial)
            partial.rename(path)
    return path


class SharedExports(Mapping):
    """shard count -> export of that many shards, each made on first use (by one xdist worker)."""

    def __init__(self, workdir: Path, prefix: str, counts, **overrides):
        self.workdir, self.prefix, self.counts, self.overrides = workdir, prefix, counts, overrides

    def __getitem__(self, n: int) -> Path:
        if n not in self.counts:
            raise KeyError(n)
        return made_once(self.workdir / f"{self.prefix}_{n}", lambda path: export(path, shards=n, **self.overrides))

    def __iter__(self):
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)


@pytest.fixture(scope="session")
def default_exports(workdir) -> Mapping[int, Path]:
    return SharedExports(workdir, "default", SHARD_COUNTS)


@pytest.fixture(scope="session")
def default_8da4w_export(workdir) -> Path:
    return made_once(
        workdir / "default_3_8da4w", lambda p: export(p, shards=3, xnnpack={"quantize": "8da4w", "group_size": 32})
    )


@pytest.fixture(scope="session")
def llama3_checkpoint(workdir) -> Path:
    folder = made_once(workdir / "llama3_ckpt", lambda p: write_meta_checkpoint(p, LLAMA3_PARAMS, seed=7))
    return folder / "consolidated.00.pth"


# For tests of the export's machinery (caching, resuming, races), not of a model: 3 layers, so each
# shard of 1 or 3 lowers in about half the time the default's 6 layers take.
SMALL_PARAMS = {**LLAMA3_PARAMS, "n_layers": 3, "vocab_size": 512}


@pytest.fixture(scope="session")
def small_checkpoint(workdir) -> Path:
    folder = made_once(workdir / "small_ckpt", lambda p: write_meta_checkpoint(p, SMALL_PARAMS, seed=11))
    return folder / "consolidated.00.pth"


@pytest.fixture(scope="session")
def llama3_exports(workdir, llama3_checkpoint) -> Mapping[int, Path]:
    return SharedExports(workdir, "llama3", LLAMA3_SHARD_COUNTS, checkpoint=str(llama3_checkpoint))


@pytest.fixture(scope="session")
def default_tokenizer(workdir) -> Path:
    from composite.model.default import load_default

    return made_once(
        workdir / "default_tokenizer.model", lambda p: p.write_bytes(load_default().tokenizer_path.read_bytes())
    )


def runner_built(path: Path = RUNNER) -> bool:
    """Whether `path` (composite_runner or a tool built beside it) is there to run. The test
    command (scripts/test.sh) builds them and sets COMPOSITE_REQUIRE_RUNNER=1: a missing one then
    fails the test that needs it instead of leaving it out."""
    if path.is_file():
        return True
    if os.environ.get("COMPOSITE_REQUIRE_RUNNER") == "1":
        pytest.fail(f"{path} is not built, and COMPOSITE_REQUIRE_RUNNER=1 requires it (scripts/build_runner.sh)")
    return False


# A long real text Debian's base-files ships (composite.tune's and context shift's tests read it).
DEBIAN_TEXT = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture
def needs_debian_text() -> Path:
    """DEBIAN_TEXT, or a skip where it is missing; under the test command (COMPOSITE_REQUIRE_RUNNER=1,
    as CI runs it) a missing text fails the test instead: its checks must not quietly go."""
    if DEBIAN_TEXT.is_file():
        return DEBIAN_TEXT
    if os.environ.get("COMPOSITE_REQUIRE_RUNNER") == "1":
        pytest.fail(f"{DEBIAN_TEXT} (Debian's base-files) is missing, and the test command requires it")
    pytest.skip(f"{DEBIAN_TEXT} (Debian's base-files) is not on this machine")


@pytest.fixture
def needs_runner():
    """Skips a test when composite_runner is not built (fails it, where runner_built requires it)."""
    if not runner_built():
        pytest.skip(f"{RUNNER} not built (scripts/build_runner.sh)")


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


@dataclass(frozen=True)
class CliExport:
    folder: Path
    stdout: str
    stderr: str


def cli_export(workdir: Path, name: str, config: dict) -> CliExport:
    """`composite.export --config` of `config`, made once per run; with what the CLI printed (tests
    of its output share the export that other tests use)."""

    def make(partial: Path) -> None:
        partial.mkdir()
        (partial / "config.yaml").write_text(json.dumps(config))
        args = ["--config", str(partial / "config.yaml"), "--output", str(partial / "export")]
        result = run_cli("composite.export", *args, check=True)
        (partial / "stdout.txt").write_text(result.stdout)
        (partial / "stderr.txt").write_text(result.stderr)

    root = made_once(workdir / name, make)
    return CliExport(root / "export", (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text())


SIX_SHARDS_QNN = {
    "shards": 6,
    "placement": FP16_PLACEMENT,
    "max_seq_len": MAX_SEQ_LEN,
    "prefill_len": PREFILL_LEN,
    "qnn": {"weight_sharing": False},
}


def qnn_fp16_cli(workdir: Path) -> CliExport:
    """The 6-shard default with four QNN fp16 shards."""
    return cli_export(workdir, "qnn_fp16_6", SIX_SHARDS_QNN)


# Two adjacent quantized QNN shards (each ~2x an fp16 one to lower): every boundary a QNN shard has,
# CPU to QNN, QNN to QNN, QNN to CPU; the CPU shards are the 6-shard default's, from the run's cache.
QUANTIZED_PLACEMENT = ["xnnpack", "xnnpack", "xnnpack", "qnn", "qnn", "xnnpack"]


def qnn_quantized_cli(workdir: Path, precision: str) -> CliExport:
    """Shards 3 and 4 on QNN at `precision` (8 calibration samples per method), not rotated:
    tests/test_qnn_native_io.py records their SQNR."""
    config = {**SIX_SHARDS_QNN, "placement": QUANTIZED_PLACEMENT, "rotate": "none"}
    config["qnn"] = {**config["qnn"], "precision": precision, "calibration": {"samples": 8}}
    return cli_export(workdir, f"qnn_{precision}_6", config)


@pytest.fixture(scope="session")
def qnn_fp16_export(qnn_ready, workdir):
    return qnn_fp16_cli(workdir).folder
