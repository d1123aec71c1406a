"""QNN shards' native I/O on the HTP simulator: float16, uint16 or uint8 hidden states and KV
caches in the manifest and the programs, one encoding per cache and between adjacent QNN shards,
both runners holding the cache in its width; quantized shards' SQNR; manifests that lie about it.

Apart from tests/test_qnn.py so that pytest-xdist runs the two files' exports on both cores.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess

import pytest
from test_qnn import cpp_stats

from composite import manifest as manifest_schema
from composite.shard_cache import ENTRY_FILE
from conftest import QUANTIZED_PLACEMENT, RUNNER, one_error_line, qnn_quantized_cli, run_cli

# SQNR (dB) of each quantized QNN shard's hidden output on its held-out input, decode / prefill,
# with float32 I/O (`native_io: false`), as measured on 2026-12-01 (mask floor -255, calibration
# passes starting with BOS): embedded default, 6 shards (xnnpack, qnn x 4, xnnpack), 8
# calibration samples per method. A QNN shard is calibrated and measured on the float model's output
# of the shards before it, whatever runs them: the tests export shards 3 and 4 on QNN
# (conftest.QUANTIZED_PLACEMENT) and hold their default quantized I/O within 3 dB of these.
# 16a4w_block (blocks of 32, GPTQ rounding): shards 3 and 4 of that placement, 2026-12-06.
MEASURED_FLOAT_IO_SQNR = {
    "16a4w": {1: (38.6, 32.5), 2: (36.9, 33.5), 3: (38.7, 32.6), 4: (36.3, 32.6)},
    "16a4w_block": {3: (42.0, 34.7), 4: (41.2, 34.1)},
    "8a8w": {1: (29.7, 28.0), 2: (31.0, 28.9), 3: (31.9, 29.2), 4: (32.8, 29.5)},
}
# Each quantized precision's export costs a few minutes of CI: CI runs the 4-bit ones,
# COMPOSITE_TEST_ALL_QNN=1 adds 8a8w. (conftest.qnn_quantized_cli: 8 calibration samples per
# method, not rotated.)
QUANTIZED = (
    ("16a4w", "16a4w_block", "8a8w") if os.environ.get("COMPOSITE_TEST_ALL_QNN") == "1" else ("16a4w", "16a4w_block")
)
FLOAT_IO_SQNR = {precision: MEASURED_FLOAT_IO_SQNR[precision] for precision in QUANTIZED}
NATIVE_IO_DTYPE = {"fp16": "float16", "16a4w": "uint16", "16a4w_block": "uint16", "8a8w": "uint8"}
IO_DTYPE = {p: NATIVE_IO_DTYPE[p] for p in ("fp16", *QUANTIZED)}  # native I/O per precision
NATIVE_PRECISIONS = sorted(IO_DTYPE)


@pytest.fixture(scope="session")
def quantized_exports(qnn_ready, workdir):
    """precision -> (export folder, export CLI stdout)."""
    return {
        precision: (made.folder, made.stdout)
        for precision in FLOAT_IO_SQNR
        for made in [qnn_quantized_cli(workdir, precision)]
    }


@pytest.mark.parametrize("precision", sorted(FLOAT_IO_SQNR))
def test_quantized_shard_sqnr_is_printed_and_within_3_db_of_float_io(quantized_exports, precision):
    folder, stdout = quantized_exports[precision]
    for index in (i for i, backend in enumerate(QUANTIZED_PLACEMENT) if backend == "qnn"):
        float_io = FLOAT_IO_SQNR[precision][index]
        shard = manifest_schema.read(folder)["shards"][index]
        assert shard["backends"] == ["QnnBackend"]
        measured = (shard["sqnr_db"]["decode"]["hidden"], shard["sqnr_db"]["prefill"]["hidden"])
        assert f"{measured[0]:.1f}/{measured[1]:.1f}" in stdout
        for method, value, expected in zip(("decode", "prefill"), measured, float_io):
            assert abs(value - expected) <= 3.0, f"{precision} shard {index} {method}: {value} dB, float I/O {expected}"


def native_value_io(shard: dict, method: str) -> list[tuple[str, dict]]:
    """(direction, tensor entry) of the shard's hidden-state and cache I/O."""
    io = shard["io"][method]
    return [
        (side, t)
        for side in ("inputs", "outputs")
        for t in io[side]
        if t["name"] == "hidden" or t["name"].split(".")[0] in ("k_cache", "v_cache", "k_new", "v_new")
    ]


@pytest.fixture(params=NATIVE_PRECISIONS)
def native_export(request):
    """(precision, export folder): the 6-shard default with fp16, 16a4w or 8a8w QNN shards."""
    if request.param == "fp16":
        return request.param, request.getfixturevalue("qnn_fp16_export")
    return request.param, request.getfixturevalue("quantized_exports")[request.param][0]


def test_qnn_cache_and_hidden_io_are_native_and_shared(native_export):
    from executorch.runtime import Runtime

    precision, folder = native_export
    manifest = manifest_schema.read(folder)
    shards = manifest["shards"]
    qnn = [s for s in shards if s["placement"]["backend"] == "qnn"]
    for shard in qnn:
        program = Runtime.get().load_program(folder / shard["file"])
        for method in manifest["methods"]:
            entries = native_value_io(shard, method)
            assert len(entries) == 2 + 4 * (shard["layers"][1] - shard["layers"][0])
            meta = program.metadata(method)
            for side, entry in entries:
                assert entry["dtype"] == IO_DTYPE[precision], entry
                assert precision == "fp16" or entry["quant"]["scale"] > 0, entry
                position = [t["name"] for t in shard["io"][method][side]].index(entry["name"])
                info = meta.input_tensor_meta(position) if side == "inputs" else meta.output_tensor_meta(position)
                assert manifest_schema.SCALAR_TYPE_NAMES[int(info.dtype())] == IO_DTYPE[precision]
        # One scale and zero point per cache, for its input and its new entries, in every method.
        for layer in range(*shard["layers"]):
            for kind in ("k", "v"):
                quants = {
                    json.dumps(t.get("quant"), sort_keys=True)
                    for method in manifest["methods"]
                    for side, t in native_value_io(shard, method)
                    if t["name"] in (f"{kind}_cache.{layer}", f"{kind}_new.{layer}")
                }
                assert len(quants) == 1, (shard["index"], kind, layer, quants)
    # Between adjacent QNN shards the hidden state passes untouched: the same encoding on both sides;
    # the CPU ends take and give float32.
    for left, right in itertools.pairwise(shards):
        for method in manifest["methods"]:
            produced, wanted = left["io"][method]["outputs"][0], right["io"][method]["inputs"][0]
            if left in qnn and right in qnn:
                assert produced == wanted
            elif right not in qnn:
                assert wanted["dtype"] == "float32"


def test_native_io_runners_agree_and_hold_the_cache_in_its_width(needs_runner, native_export, tmp_path):
    precision, folder = native_export
    python = json.loads(
        run_cli(
            "composite.run",
            "--artifacts",
            str(folder),
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "32",
            "--json",
            check=True,
        ).stdout
    )
    figures, _ = cpp_stats(folder, tmp_path / "stats.json")
    assert figures["tokens"] == python["tokens"] and len(python["tokens"]) == 32
    assert figures["kv_cache_bytes_per_shard"] == python["kv_cache_bytes_per_shard"]
    manifest = manifest_schema.read(folder)
    float32_layer = 4 * 2 * manifest["model"]["n_kv_heads"] * manifest["model"]["head_dim"] * manifest["max_seq_len"]
    ratio = {"fp16": 0.5, "16a4w": 0.5, "16a4w_block": 0.5, "8a8w": 0.25}[precision]
    for shard, held in zip(manifest["shards"], figures["kv_cache_bytes_per_shard"]):
        float32 = float32_layer * (shard["layers"][1] - shard["layers"][0])
        if shard["placement"]["backend"] == "qnn":
            assert held <= ratio * float32, (shard["index"], held, float32)
        else:
            assert held == float32


def test_a_quantized_cache_shifted_past_the_context_gives_the_same_tokens_in_both_runners(
    needs_runner, quantized_exports, tmp_path
):
    """The QNN shards' uint16 caches, dequantized, re-rotated and quantized again with each layer's
    own scale and zero point by both runners (composite/runtime/context_shift.py), past a context
    of 96 three times."""
    folder = quantized_exports["16a4w"][0]
    args = ["--prompt", "Once upon a time", "--max-new-tokens", "160", "--evict", "40", "--json"]
    python = json.loads(run_cli("composite.run", "--artifacts", str(folder), *args, check=True).stdout)
    figures, _ = cpp_stats(folder, tmp_path / "stats.json", 160, "--evict", "40")
    assert python["context_shifts"] == figures["context_shifts"] >= 2
    assert figures["tokens"] == python["tokens"] and len(python["tokens"]) == 160


def quantized_io_manifest_error(folder, tmp_path, edit) -> list[str]:
    """The one error line of each runner on a copy of `folder` whose manifest `edit` changed."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    args = ["--artifacts", str(copy), "--prompt", "Once upon a time", "--max_new_tokens", "2"]
    return [
        one_error_line(subprocess.run([str(RUNNER), *args], capture_output=True, text=True)),
        one_error_line(run_cli("composite.run", *args)),
    ]


def test_a_quantized_io_manifest_that_lies_gets_one_line_in_both_runners(quantized_exports, tmp_path):
    folder, _ = quantized_exports["16a4w"]

    first_qnn = QUANTIZED_PLACEMENT.index("qnn")

    def entries(manifest, name):
        shard = manifest["shards"][first_qnn]
        return [t for io in shard["io"].values() for side in io.values() for t in side if t["name"] == name]

    def without_scale(manifest):
        del entries(manifest, "hidden")[0]["quant"]["scale"]

    def zero_scale(manifest):
        entries(manifest, "hidden")[0]["quant"]["scale"] = 0

    def as_uint8(manifest):  # consistent in the manifest, but not what the .pte takes
        layer = manifest["shards"][first_qnn]["layers"][0]
        for t in entries(manifest, f"k_cache.{layer}") + entries(manifest, f"k_new.{layer}"):
            t["dtype"], t["quant"]["zero_point"] = "uint8", 128

    for edit, phrase in (
        (without_scale, "quant has no 'scale'"),
        (zero_scale, "quant 'scale' must be a positive number, got 0"),
        (as_uint8, "program has [2, 32, 96] uint16, manifest says [2, 32, 96] uint8"),
    ):
        for line in quantized_io_manifest_error(folder, tmp_path / edit.__name__, edit):
            assert phrase in line, line


# What a QNN context binary holds beside the weights htp_limits estimates: each method's graph (its
# ops, tensors and encodings), at most this many bytes a method and layer on the shapes measured
# (docs/placement.md, "The HTP's memory limits").
GRAPH_BYTES_PER_METHOD_AND_LAYER = 160_000


@pytest.mark.parametrize("precision", ["fp16", *sorted(FLOAT_IO_SQNR)])
def test_the_htp_estimate_of_a_shards_weights_is_what_its_compiled_contexts_hold(
    precision, quantized_exports, qnn_fp16_export
):
    """The estimate that cuts QNN shards to the HTP's limits (split/htp_limits.py), and the bytes
    composite.tune counts for the shard's layers (tune/candidates.py), against the bytes of the
    context binaries compiled on the simulator: never more than them, and below them by at most 5%
    and the graphs' own bytes (a context of the host twin holds its weights once per method)."""
    from composite.model.llama import ModelArgs
    from composite.split.htp_limits import estimate
    from composite.split.plan import ShardSpec
    from composite.tune.candidates import Candidate, Group, group_bytes

    folder = qnn_fp16_export if precision == "fp16" else quantized_exports[precision][0]
    manifest = manifest_schema.read(folder)
    args = ModelArgs(**{k: v for k, v in manifest["model"].items() if k in ModelArgs.__dataclass_fields__})
    qnn = [s for s in manifest["shards"] if s["placement"]["backend"] == "qnn"]
    assert qnn
    for shard in qnn:
        spec = ShardSpec(shard["index"], *shard["layers"], shard["has_embedding"], shard["has_head"])
        options = shard["placement"]["options"]
        weights = estimate(args, spec, options, manifest["max_seq_len"], manifest["methods"]).weights
        graphs = GRAPH_BYTES_PER_METHOD_AND_LAYER * len(manifest["methods"]) * max(1, len(spec.layers))
        measured = shard["htp_context_bytes"]
        assert weights <= measured <= 1.05 * weights + graphs, (shard["index"], weights, measured)
        group = Group("layers", shard["index"], *shard["layers"])
        rotation = manifest["source"].get("rotation", "none")
        tuned = len(manifest["methods"]) * group_bytes(group, Candidate("qnn", precision), args, 32, rotation)[0]
        assert tuned <= measured <= 1.05 * tuned + graphs, (shard["index"], tuned, measured)


def test_a_quantized_qnn_shard_lowered_twice_is_byte_identical(quantized_exports, shard_cache, tmp_path):
    """The shard cache and --ray take a shard's bytes as a function of its inputs: the 16a4w shards
    of the export above lowered again, nothing of theirs in the cache, give the same files. The
    export's XNNPACK shards come from a cache of their own entries (test_determinism lowers those
    twice), so only the QNN shards are lowered again."""
    folder = quantized_exports["16a4w"][0]
    first = manifest_schema.read(folder)
    qnn = [index for index, backend in enumerate(QUANTIZED_PLACEMENT) if backend == "qnn"]
    xnnpack = {shard["sha256"] for shard in first["shards"] if shard["index"] not in qnn}
    cache = tmp_path / "xnnpack_only"
    for entry in shard_cache.glob(f"??/*/{ENTRY_FILE}"):
        if json.loads(entry.read_text())["sha256"] in xnnpack:
            shutil.copytree(entry.parent, cache / entry.parent.relative_to(shard_cache))
    again = tmp_path / "again"
    env = {**os.environ, "COMPOSITE_CACHE": str(cache)}
    run_cli(
        "composite.export", "--config", str(folder.parent / "config.yaml"), "--output", str(again), env=env, check=True
    )
    second = manifest_schema.read(again)
    assert [shard["cache"] for shard in second["shards"]] == [
        "stored" if index in qnn else "hit" for index in range(len(QUANTIZED_PLACEMENT))
    ]
    for index in qnn:
        assert first["shards"][index]["sha256"] == second["shards"][index]["sha256"], index
