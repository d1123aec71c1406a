"""XNNPACK fp16 and 8da8w shards: what the manifest and program say, and greedy tokens equal to
the same model in eager PyTorch at the same precision, in both runners."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from torch import nn

from composite.lowering.embedding import QuantizedEmbedding
from composite.lowering.xnnpack import half_form, quantize_linears, xnnpack_form
from composite.manifest import DECODE, PREFILL, method_widths
from composite.model.default import corpus_text, load_default
from composite.model.rotation import rotate
from composite.placement_options import DEFAULT_OPTIONS
from composite.runtime.chain import ShardChain, eager_chain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule
from conftest import MAX_SEQ_LEN, PREFILL_LEN, RUNNER, assert_clean_failure, export, run_cli, runner_built

PROMPT = list(range(1, 20))
NEW_TOKENS = 16


class Float32Boundary(nn.Module):
    """An fp16 form run by the eager chain, which keeps float32 tensors: float16 values survive the
    round trip through float32 exactly, so this is the fp16 model's arithmetic."""

    def __init__(self, half: nn.Module, spec):
        super().__init__()
        self.form, self.spec = half, spec

    def forward(self, x, *inputs):
        x = x.half() if x.is_floating_point() else x
        caches = [t.half() if t.dtype == torch.float32 and t.dim() == 3 else t for t in inputs]
        return [t.float() for t in self.form(x, *caches)]


def eager_generation(shards: int, precision: str, rotation: str = "none", embedding: tuple | None = None):
    """rotation: the export's `rotate`; embedding: (bits, group) of a quantized table in shard 0,
    looked up as the export does."""
    model = load_default().model
    rotate(model, rotation)
    modules = []
    for spec in plan_shards(model.args, shards):
        shard = ShardModule(model, spec).eval()
        if embedding and spec.has_embedding:
            shard.tok_embeddings = QuantizedEmbedding(model.tok_embeddings.weight, *embedding)
        if precision == "fp16":
            form = Float32Boundary(half_form(xnnpack_form(shard, "kernel"), spec.has_head), spec)
        else:
            options = {**DEFAULT_OPTIONS["xnnpack"], "quantize": precision}
            form, _ = quantize_linears(xnnpack_form(shard, "kernel"), options)
            form.spec = spec
        modules.append(form)
    chain = eager_chain(model, modules, method_widths(PREFILL_LEN), MAX_SEQ_LEN)
    return generate(chain, PROMPT, NEW_TOKENS, Sampler(), keep_logits=True)


def eager_tokens(shards: int, precision: str, rotation: str = "none") -> list[int]:
    return eager_generation(shards, precision, rotation).tokens


def runner_tokens(folder) -> list[int]:
    stats = folder / "stats.json"
    ids = ",".join(map(str, PROMPT))
    result = subprocess.run(
        [str(RUNNER), "--artifacts", str(folder), "--prompt_ids", ids, "--max_new_tokens", str(NEW_TOKENS)]
        + ["--stats_json", str(stats)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(stats.read_text())


@pytest.fixture(scope="session")
def fp16_export(workdir):
    return export(workdir / "default_3_fp16", shards=3, xnnpack={"dtype": "fp16"})


@pytest.fixture(scope="session")
def int8_export(workdir):
    return export(workdir / "default_3_8da8w", shards=3, xnnpack={"quantize": "8da8w"})


def test_fp16_shards_take_and_give_float16(fp16_export, default_exports):
    manifest = json.loads((fp16_export / "manifest.json").read_text())
    fp32 = json.loads((default_exports[3] / "manifest.json").read_text())
    for shard, float_shard in zip(manifest["shards"], fp32["shards"]):
        assert shard["placement"]["options"]["dtype"] == "fp16"
        assert shard["backends"] == ["XnnpackBackend"]
        assert shard["size"] < 0.6 * float_shard["size"]
        for method in (DECODE, PREFILL):
            for tensor in shard["io"][method]["inputs"] + shard["io"][method]["outputs"]:
                native = tensor["name"] == "hidden" or tensor["name"].split(".")[0] in (
                    "k_cache",
                    "v_cache",
                    "k_new",
                    "v_new",
                )
                expected = (
                    "float16" if native else {"logits": "float32", "mask": "float32"}.get(tensor["name"], "int64")
                )
                assert tensor["dtype"] == expected, (shard["index"], method, tensor["name"])


def test_fp16_greedy_tokens_are_the_fp16_models(fp16_export):
    expected = eager_tokens(3, "fp16")
    assert generate(ShardChain(fp16_export), PROMPT, NEW_TOKENS, Sampler()).tokens == expected
    if runner_built():
        stats = runner_tokens(fp16_export)
        assert stats["tokens"] == expected
        args = load_default().model.args
        float32_bytes = args.n_layers * 2 * 4 * MAX_SEQ_LEN * args.n_kv_heads * args.head_dim
        assert stats["kv_cache_bytes"] * 2 == float32_bytes  # float16 caches


def test_an_fp16_export_with_a_quantized_embedding_looks_it_up_in_float16(workdir, fp16_export):
    """The quantized embedding's kernels give float32 unless asked: an fp16 shard 0 asks for float16."""
    folder = export(
        workdir / "default_3_fp16_embedding_4", shards=3, xnnpack={"dtype": "fp16"}, embedding_quantize="4,32"
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    first = manifest["shards"][0]
    assert first["notes"][0].startswith("embedding 4-bit")
    for method in (DECODE, PREFILL):
        assert [t["dtype"] for t in first["io"][method]["outputs"] if t["name"] == "hidden"] == ["float16"]
    fp16 = json.loads((fp16_export / "manifest.json").read_text())
    assert [s["sha256"] for s in manifest["shards"][1:]] == [s["sha256"] for s in fp16["shards"][1:]]
    # The prompt's logits are the fp16 model's with this table, not with the float one; the tokens
    # after them are not compared: the tiny default's random weights leave near-ties that float16
    # rounding decides (here two tokens 0.002 apart).
    last = len(PROMPT) - 1
    eager = eager_generation(3, "fp16", embedding=(4, 32)).logits[last]
    ours = generate(ShardChain(folder), PROMPT, NEW_TOKENS, Sampler(), keep_logits=True)
    float_table = generate(ShardChain(fp16_export), PROMPT, 1, Sampler(), keep_logits=True).logits[last]
    assert (ours.logits[last] - eager).abs().max() < 0.02
    assert (float_table - eager).abs().max() > 0.05
    if runner_built():
        assert runner_tokens(folder)["tokens"] == ours.tokens


def test_8da8w_shards_are_int8_and_give_the_quantized_models_tokens(int8_export, default_exports):
    manifest = json.loads((int8_export / "manifest.json").read_text())
    fp32 = json.loads((default_exports[3] / "manifest.json").read_text())
    for shard, float_shard in zip(manifest["shards"], fp32["shards"]):
        assert shard["placement"]["options"]["quantize"] == "8da8w"
        assert shard["backends"] == ["XnnpackBackend"]
        # int8 weights with a scale per output channel: about a quarter of the linears' bytes
        assert shard["size"] < 0.6 * float_shard["size"]
    # 8da8w on XNNPACK rotates the residual stream and the feed-forwards' hidden activations by
    # default (rotate: auto): the eager model is rotated too
    assert manifest["source"]["rotation"] == "hadamard-ffn"
    expected = eager_tokens(3, "8da8w", rotation="hadamard-ffn")
    assert generate(ShardChain(int8_export), PROMPT, NEW_TOKENS, Sampler()).tokens == expected
    if runner_built():
        assert runner_tokens(int8_export)["tokens"] == expected


def test_each_rotated_shard_is_measured_against_the_float_shard_in_its_basis(int8_export):
    """composite.eval --per-shard compares a rotated export's hidden states with float shards of
    the rotated model: against the unrotated ones every shard but the last would be noise."""
    text = corpus_text()
    folder = int8_export.parent / "eval_text"
    folder.mkdir(exist_ok=True)
    (folder / "corpus.txt").write_text(text)
    args = [
        "--artifacts",
        str(int8_export),
        "--text",
        str(folder / "corpus.txt"),
        "--ctx",
        "48",
        "--limit-tokens",
        "96",
    ]
    result = json.loads(
        run_cli("composite.eval", *args, "--reference", "eager", "--per-shard", "--json", check=True).stdout
    )
    assert [s["index"] for s in result["shards"]] == [0, 1, 2]
    assert all(s["sqnr_db"] > 20 for s in result["shards"]), result["shards"]
    assert result["kld_mean"] < 0.05 and result["top1_agreement"] > 0.8


def test_fp16_with_quantized_linears_is_refused(tmp_path):
    result = run_cli("composite.export", "--dtype", "fp16", "--quantize", "8da4w", "--output", str(tmp_path / "x"))
    assert_clean_failure(result, "dtype fp16 is for unquantized shards", output=tmp_path / "x")
