"""QNN HTP shards, lowered for real and run on the x86 HTP simulator.

Needs the QNN host libraries on this process's loader path: scripts/test.sh starts pytest after
`eval "$(python -m composite.qnn_host env)"` and sets COMPOSITE_REQUIRE_QNN=1, so in CI these tests
run or fail, never skip.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from composite import manifest as manifest_schema
from composite.runtime.encoding import Encoding, convert
from conftest import (
    FP16_PLACEMENT,
    MAX_SEQ_LEN,
    PREFILL_LEN,
    REPO,
    RUNNER,
    assert_clean_failure,
    export,
    one_error_line,
    run_cli,
    write_meta_checkpoint,
)

# SQNR (dB) of each quantized QNN shard's hidden output on its held-out input, decode / prefill,
# with float32 I/O (`native_io: false`), as measured on 2026-12-01 (mask floor -255, calibration
# passes starting with BOS): embedded default, 6 shards (xnnpack, qnn x 4, xnnpack), 8
# calibration samples per method. The tests hold the default quantized I/O within 3 dB of these.
MEASURED_FLOAT_IO_SQNR = {
    "16a4w": {1: (38.6, 32.5), 2: (36.9, 33.5), 3: (38.7, 32.6), 4: (36.3, 32.6)},
    "8a8w": {1: (29.7, 28.0), 2: (31.0, 28.9), 3: (31.9, 29.2), 4: (32.8, 29.5)},
}
# Each quantized precision's export costs ~5 min of CI: CI runs 16a4w, COMPOSITE_TEST_ALL_QNN=1 adds 8a8w.
QUANTIZED = ("16a4w", "8a8w") if os.environ.get("COMPOSITE_TEST_ALL_QNN") == "1" else ("16a4w",)
FLOAT_IO_SQNR = {precision: MEASURED_FLOAT_IO_SQNR[precision] for precision in QUANTIZED}
NATIVE_IO_DTYPE = {"fp16": "float16", "16a4w": "uint16", "8a8w": "uint8"}
IO_DTYPE = {p: NATIVE_IO_DTYPE[p] for p in ("fp16", *QUANTIZED)}  # native I/O per precision
NATIVE_PRECISIONS = sorted(IO_DTYPE)
CALIBRATION = {"samples": 8}


@pytest.fixture(scope="session")
def quantized_exports(qnn_ready, workdir):
    """precision -> (export folder, export CLI stdout)."""
    results = {}
    for precision in FLOAT_IO_SQNR:
        config = workdir / f"qnn_{precision}.yaml"
        config.write_text(
            json.dumps(
                {
                    "shards": 6,
                    "placement": FP16_PLACEMENT,
                    "max_seq_len": MAX_SEQ_LEN,
                    "prefill_len": PREFILL_LEN,
                    "qnn": {"precision": precision, "calibration": CALIBRATION, "weight_sharing": False},
                }
            )
        )
        folder = workdir / f"qnn_{precision}"
        result = run_cli("composite.export", "--config", str(config), "--output", str(folder), check=True)
        results[precision] = (folder, result.stdout)
    return results


def shard_inputs(folder, samples: int = 2) -> tuple[dict, list]:
    """Inputs every shard receives when the float model runs text: {index: {method: [tuples]}}."""
    from composite.lowering.calibration import calibrate
    from composite.model.default import load_default
    from composite.split.plan import ShardSpec
    from composite.split.shard import ShardModule
    from composite.tokenizer import Tokenizer

    manifest = manifest_schema.read(folder)
    loaded = load_default()
    modules = []
    for s in manifest["shards"]:
        spec = ShardSpec(s["index"], s["layers"][0], s["layers"][1], s["has_embedding"], s["has_head"])
        modules.append(ShardModule(loaded.model, spec).eval())
    captured = {index: {method: [] for method in manifest["methods"]} for index in range(len(modules))}

    def recorder(index):
        def record(method, inputs):
            if len(captured[index][method]) < samples:
                captured[index][method].append(tuple(t.clone() for t in inputs))

        return record

    tokenizer = Tokenizer(folder / manifest["tokenizer"]["file"])
    held_out = calibrate(
        loaded.model,
        modules,
        {i: recorder(i) for i in captured},
        manifest["methods"],
        manifest["max_seq_len"],
        {"samples": samples},
        tokenizer,
    )
    for index, per_method in held_out.items():
        for method, inputs in per_method.items():
            captured[index][method].append(inputs)
    return captured, modules


def test_fp16_middle_shards_are_qnn_and_each_matches_eager(qnn_fp16_export):
    from executorch.runtime import Runtime

    manifest = manifest_schema.read(qnn_fp16_export)
    for shard, backend in zip(manifest["shards"], FP16_PLACEMENT):
        expected = "QnnBackend" if backend == "qnn" else "XnnpackBackend"
        assert shard["backends"] == [expected]
        if backend == "qnn":  # the whole shard is one QNN graph per method, nothing left on the CPU
            assert all(counts == {expected: 1} for counts in shard["delegates"].values())
            assert not any(shard["cpu_ops"].values())
    captured, modules = shard_inputs(qnn_fp16_export)
    runtime = Runtime.get()
    for shard, module in zip(manifest["shards"], modules):
        program = runtime.load_program(qnn_fp16_export / shard["file"])
        for method, samples in captured[shard["index"]].items():
            io = shard["io"][method]
            for inputs in samples:  # fed and read in the shard's own encodings (float16 I/O)
                fed = [convert(t, None, Encoding.of(entry)) for t, entry in zip(inputs, io["inputs"])]
                actual = convert(program.load_method(method).execute(fed)[0], Encoding.of(io["outputs"][0]), None)
                with torch.no_grad():
                    expected = module(*inputs)[0]
                cosine = torch.nn.functional.cosine_similarity(
                    actual.flatten().double(), expected.flatten().double(), dim=0
                )
                assert cosine >= 0.999, f"shard {shard['index']} {method}: cosine {cosine:.6f}"


def greedy_tokens(*args: str) -> list[int]:
    result = run_cli(
        "composite.run", *args, "--prompt", "Once upon a time", "--max-new-tokens", "32", "--json", check=True
    )
    return json.loads(result.stdout)["tokens"]


def cpp_stats(folder, stats, max_new_tokens: int = 32) -> tuple[dict, str]:
    """composite_runner's greedy run of the test prompt: (its stats JSON, its stderr)."""
    result = subprocess.run(
        [str(RUNNER), "--artifacts", str(folder), "--prompt", "Once upon a time"]
        + ["--max_new_tokens", str(max_new_tokens), "--stats_json", str(stats)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(stats.read_text()), result.stderr


def test_fp16_generation_equals_eager_in_both_runners(qnn_fp16_export):
    reference = greedy_tokens("--artifacts", str(qnn_fp16_export), "--reference")
    assert greedy_tokens("--artifacts", str(qnn_fp16_export)) == reference
    if not RUNNER.exists():
        pytest.skip("composite_runner is not built (scripts/build_runner.sh)")
    stats, stderr = cpp_stats(qnn_fp16_export, qnn_fp16_export.parent / "qnn_fp16_stats.json")
    assert stats["tokens"] == reference
    assert "warning: the QNN shards were compiled" not in stderr


@pytest.mark.parametrize("precision", sorted(FLOAT_IO_SQNR))
def test_quantized_shard_sqnr_is_printed_and_within_3_db_of_float_io(quantized_exports, precision):
    folder, stdout = quantized_exports[precision]
    for index, float_io in FLOAT_IO_SQNR[precision].items():
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


def test_native_io_runners_agree_and_hold_the_cache_in_its_width(native_export, tmp_path):
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
    ratio = {"fp16": 0.5, "16a4w": 0.5, "8a8w": 0.25}[precision]
    for shard, held in zip(manifest["shards"], figures["kv_cache_bytes_per_shard"]):
        float32 = float32_layer * (shard["layers"][1] - shard["layers"][0])
        if shard["placement"]["backend"] == "qnn":
            assert held <= ratio * float32, (shard["index"], held, float32)
        else:
            assert held == float32


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

    def entries(manifest, name):
        shard = manifest["shards"][1]
        return [t for io in shard["io"].values() for side in io.values() for t in side if t["name"] == name]

    def without_scale(manifest):
        del entries(manifest, "hidden")[0]["quant"]["scale"]

    def zero_scale(manifest):
        entries(manifest, "hidden")[0]["quant"]["scale"] = 0

    def as_uint8(manifest):  # consistent in the manifest, but not what the .pte takes
        for t in entries(manifest, "k_cache.1") + entries(manifest, "k_new.1"):
            t["dtype"], t["quant"]["zero_point"] = "uint8", 128

    for edit, phrase in (
        (without_scale, "quant has no 'scale'"),
        (zero_scale, "quant 'scale' must be a positive number, got 0"),
        (as_uint8, "program has [2, 32, 96] uint16, manifest says [2, 32, 96] uint8"),
    ):
        for line in quantized_io_manifest_error(folder, tmp_path / edit.__name__, edit):
            assert phrase in line, line


def test_skip_ops_leaves_linears_to_xnnpack_inside_the_qnn_shard(qnn_ready, workdir):
    folder = export(
        workdir / "qnn_skip",
        shards=3,
        placement=["xnnpack", {"backend": "qnn", "skip_ops": ["aten.linear.default"]}, "xnnpack"],
    )
    shard = manifest_schema.read(folder)["shards"][1]
    assert shard["backends"] == ["QnnBackend", "XnnpackBackend"]
    assert greedy_tokens("--artifacts", str(folder)) == greedy_tokens("--artifacts", str(folder), "--reference")


def test_spill_fill_is_shared_and_is_the_largest_need(qnn_ready, workdir):
    # A wide feed-forward and a 128-token prefill need HTP spill-fill memory even at this size.
    params = {
        "dim": 256,
        "n_layers": 2,
        "n_heads": 8,
        "n_kv_heads": 2,
        "vocab_size": 300,
        "hidden_dim": 16384,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    checkpoint = write_meta_checkpoint(workdir / "wide_ckpt", params, seed=3)
    folder = export(
        workdir / "qnn_spill",
        shards=4,
        layers_per_shard=[0, 1, 1, 0],
        checkpoint=str(checkpoint),
        placement=["xnnpack", "qnn", "qnn", "xnnpack"],
        max_seq_len=256,
        prefill_len=128,
    )
    manifest = manifest_schema.read(folder)
    needs = [s["spill_fill_bytes"] for s in manifest["shards"] if s["placement"]["backend"] == "qnn"]
    assert len(needs) == 2
    assert manifest["qnn"]["spill_fill_bytes"] == max(needs) > 0


def test_weight_sharing_shrinks_a_qnn_shard_and_the_host_runs_its_twin(qnn_ready, tmp_path):
    # One decoder layer on QNN at configs/default.yaml's cache and prefill sizes, where a QNN shard
    # holding a copy of the weights per method was 962,432 bytes.
    args = ["--config", "configs/default.yaml", "--shards", "3", "--placement", "xnnpack,qnn,xnnpack"]
    args += ["--layers-per-shard", "4,1,1"]
    shared, twin = tmp_path / "shared", tmp_path / "twin"
    run_cli("composite.export", *args, "--output", str(shared), check=True)
    run_cli("composite.export", *args, "--no-weight-sharing", "--output", str(twin), check=True)
    shared_shard, twin_shard = (manifest_schema.read(f)["shards"][1] for f in (shared, twin))
    assert (shared_shard["weight_sharing"], twin_shard["weight_sharing"]) == (True, False)
    for shard in (shared_shard, twin_shard):  # read from the program: one QNN graph per method
        assert shard["delegates"] == {"decode": {"QnnBackend": 1}, "prefill": {"QnnBackend": 1}}
    assert shared_shard["size"] <= 0.6 * 962_432 and shared_shard["size"] <= 0.6 * twin_shard["size"]
    # Its SQNR is measured on the twin: the same graphs, so the same figures as the twin export's.
    assert shared_shard["sqnr_db"] == twin_shard["sqnr_db"]

    prompt = ["--prompt", "Once upon a time", "--max_new_tokens", "4"]
    for result in (
        subprocess.run([str(RUNNER), "--artifacts", str(shared), *prompt], capture_output=True, text=True),
        run_cli("composite.run", "--artifacts", str(shared), *prompt),
    ):
        line = one_error_line(result)
        assert "shard 1 of this export shares QNN weights" in line and "--no-weight-sharing" in line

    reference = greedy_tokens("--artifacts", str(twin), "--reference")
    assert greedy_tokens("--artifacts", str(twin)) == reference
    assert cpp_stats(twin, tmp_path / "stats.json")[0]["tokens"] == reference


def test_weight_sharing_must_be_a_boolean(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("shards: 3\nplacement: [xnnpack, qnn, xnnpack]\nqnn: {weight_sharing: yes please}\n")
    result = export_error("--config", str(config), "--output", str(tmp_path / "out"))
    assert_clean_failure(result, "weight_sharing must be true or false", output=tmp_path / "out")


def export_error(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "composite.export", *args], capture_output=True, text=True, cwd=REPO, env=env
    )
    one_error_line(result)
    return result


def clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("QNN_SDK_ROOT", "COMPOSITE_QNN_HOST", "COMPOSITE_QNN_REAL_HTP", "LD_LIBRARY_PATH")
    }
    return {**env, **extra}


def test_qnn_placement_without_libraries_says_what_to_install(tmp_path):
    result = export_error(
        "--shards",
        "2",
        "--placement",
        "qnn",
        "--output",
        str(tmp_path / "out"),
        env=clean_env(QNN_SDK_ROOT=str(tmp_path)),
    )
    assert "pip install --no-deps onnxruntime-qnn" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_soc_is_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("shards: 2\nplacement: qnn\nqnn: {soc: SM8660}\n")
    result = export_error("--config", str(config), "--output", str(tmp_path / "out"))
    assert "unknown SoC 'SM8660'" in result.stderr and "SM8650" in result.stderr


def test_unverified_qnn_library_version_is_refused_by_name(tmp_path):
    # A stand-in libQnnHtp.so that reports a build id nobody verified.
    source = tmp_path / "fake.c"
    source.write_text(r"""
        #include <stdint.h>
        static uint64_t build_id(const char **id) { *id = "v2.99.0.123"; return 0; }
        static struct { uint32_t id; const char *name; uint32_t version[6]; void *functions[8]; } provider =
            {0, "fake", {2, 40, 0, 5, 99, 0}, {0, 0, 0, 0, (void *)build_id}};
        static const void *providers[] = {&provider};
        uint64_t QnnInterface_getProviders(const void ***list, uint32_t *count) {
            *list = providers; *count = 1; return 0;
        }
    """)
    lib_dir = tmp_path / "sdk" / "lib" / "x86_64-linux-clang"
    lib_dir.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib_dir / "libQnnHtp.so"), str(source)], check=True)
    result = export_error(
        "--shards",
        "2",
        "--placement",
        "qnn",
        "--output",
        str(tmp_path / "out"),
        env=clean_env(QNN_SDK_ROOT=str(tmp_path / "sdk")),
    )
    assert "v2.99.0.123" in result.stderr and "not verified" in result.stderr


# What composite's CLIs write to stderr themselves: progress bars, notes, warnings.
OUR_STDERR_PREFIXES = ("lowering shards", "calibrating", "note: ", "warning: ")


@pytest.mark.parametrize("precision", ["fp16", "16a4w"])
def test_qnn_export_and_runners_show_only_our_own_lines(qnn_ready, tmp_path, precision):
    config = tmp_path / "quiet.yaml"
    config.write_text(f"qnn: {{precision: {precision}, calibration: {{samples: 2}}, weight_sharing: false}}\n")
    out = tmp_path / "out"
    result = run_cli(
        "composite.export",
        "--config",
        str(config),
        "--shards",
        "3",
        "--layers-per-shard",
        "5,1,0",
        "--placement",
        "xnnpack,qnn,xnnpack",
        "--max-seq-len",
        "32",
        "--prefill-len",
        "4",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    pieces = [p.strip() for line in result.stderr.split("\n") for p in line.split("\r") if p.strip()]
    assert pieces and all(p.startswith(OUR_STDERR_PREFIXES) for p in pieces), pieces

    python = run_cli("composite.run", "--artifacts", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "4")
    assert python.returncode == 0, python.stderr
    assert python.stderr.strip().splitlines() == [python.stderr.strip()] and python.stderr.startswith("prompt ")
    cpp = subprocess.run(
        [
            str(RUNNER),
            "--artifacts",
            str(out),
            "--prompt",
            "Once upon a time",
            "--max_new_tokens",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert cpp.returncode == 0, cpp.stderr
    assert len(cpp.stderr.strip().splitlines()) == 1 and cpp.stderr.startswith("prompt "), cpp.stderr
    verbose = run_cli("composite.run", "--artifacts", str(out), "--prompt", "hi", "--max-new-tokens", "2", "--verbose")
    assert "[INFO] [Qnn ExecuTorch]" in verbose.stderr  # kept behind --verbose, not lost
