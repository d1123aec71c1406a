"""The benchmark script at tiny dimensions: it exports ours and the peer, runs both, and writes its
table, JSON and picture. Speed is not asserted here (that is what the benchmark prints)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "composite.bench", *args], capture_output=True, text=True, cwd=REPO)


def test_tiny_benchmark_runs_ours_and_the_peer(tmp_path):
    out = tmp_path / "out"
    done = bench(
        "--dims",
        "tiny",
        "--shards",
        "1,2",
        "--quant",
        "fp32",
        "--repeats",
        "1",
        "--work",
        str(tmp_path / "work"),
        "--output",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "bench.json").read_text())
    assert set(result["summary"]) == {"peer fp32", "ours 1 fp32", "ours 2 fp32"}
    rows = result["summary"].values()
    for row in rows:
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["size_mb"] > 0
    assert len({row["prompt_tokens"] for row in rows}) == 1  # both runners see the same prompt
    assert any(r.startswith("ours 2 fp32 / peer fp32: decode") for r in result["ratios"])
    assert any(r.startswith("ours 2 fp32 / ours 1 fp32: decode") for r in result["ratios"])
    assert "| ours 2 fp32 |" in done.stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_benchmark_flags_get_one_line(tmp_path):
    done = bench("--quant", "int3", "--output", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --quant: unknown value 'int3' (choose from fp32, fp16, 8da8w, 8da4w)"
    ]
    done = bench("--runner", str(tmp_path / "nope"), "--output", str(tmp_path))
    assert done.returncode == 2 and "composite_runner not found" in done.stderr
    done = bench("--llama-cpp", str(tmp_path / "no_llama"), "--output", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: llama.cpp is not built in {tmp_path / 'no_llama'}: run bash scripts/build_llama_cpp.sh "
        "(or pass --llama-cpp DIR)"
    ]


def test_llama_cpp_gets_the_benchmarks_model_as_transformers_reads_it(tmp_path):
    """The folder convert_hf_to_gguf.py reads is our checkpoint: transformers' logits equal ours."""
    import torch
    from transformers import LlamaForCausalLM

    from composite.bench.llama_cpp import write_hf_folder
    from composite.bench.workload import DIMS, write_workload
    from composite.model.checkpoint import load_checkpoint

    paths = write_workload(DIMS["tiny"], tmp_path / "workload")
    folder = write_hf_folder(paths, tmp_path / "hf")
    ours = load_checkpoint(str(paths["consolidated.00.pth"]), str(paths["params.json"])).model
    theirs = LlamaForCausalLM.from_pretrained(folder).eval()
    tokens = torch.arange(1, 17)[None]
    with torch.no_grad():
        expected = ours.forward_full(tokens)
        actual = theirs(tokens).logits
    assert (actual - expected).abs().max().item() < 1e-4
