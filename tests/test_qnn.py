"""QNN HTP shards, lowered for real and run on the x86 HTP simulator.

Needs the QNN host libraries on this process's loader path: scripts/test.sh starts pytest after
`eval "$(python -m composite.qnn_host env)"` and sets COMPOSITE_REQUIRE_QNN=1, so in CI these tests
run or fail, never skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    qnn_fp16_cli,
    qnn_quantized_cli,
    run_cli,
    runner_built,
    write_meta_checkpoint,
)


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

    from composite.ops.attention import load_kernels

    manifest = manifest_schema.read(qnn_fp16_export)
    for shard, backend in zip(manifest["shards"], FP16_PLACEMENT):
        expected = "QnnBackend" if backend == "qnn" else "XnnpackBackend"
        assert shard["backends"] == [expected]
        if backend == "qnn":  # the whole shard is one QNN graph per method, nothing left on the CPU
            assert all(counts == {expected: 1} for counts in shard["delegates"].values())
            assert not any(shard["cpu_ops"].values())
    captured, modules = shard_inputs(qnn_fp16_export)
    load_kernels()  # the XNNPACK ends call composite::attention; ShardChain loads it, this test runs programs itself
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


def cpp_stats(folder, stats, max_new_tokens: int = 32, *flags: str) -> tuple[dict, str]:
    """composite_runner's greedy run of the test prompt: (its stats JSON, its stderr)."""
    result = subprocess.run(
        [str(RUNNER), "--artifacts", str(folder), "--prompt", "Once upon a time"]
        + ["--max_new_tokens", str(max_new_tokens), "--stats_json", str(stats), *flags],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(stats.read_text()), result.stderr


def test_fp16_generation_equals_eager_in_both_runners(qnn_fp16_export):
    reference = greedy_tokens("--artifacts", str(qnn_fp16_export), "--reference")
    assert greedy_tokens("--artifacts", str(qnn_fp16_export)) == reference
    if not runner_built():
        pytest.skip("composite_runner is not built (scripts/build_runner.sh)")
    stats, stderr = cpp_stats(qnn_fp16_export, qnn_fp16_export.parent / "qnn_fp16_stats.json")
    assert stats["tokens"] == reference
    assert "warning: the QNN shards were compiled" not in stderr


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
    # One decoder layer on QNN (configs/default.yaml's QNN settings); the other shards are the
    # 6-shard default's, from the run's cache.
    args = ["--config", "configs/default.yaml", "--placement", "xnnpack,qnn,xnnpack,xnnpack,xnnpack,xnnpack"]
    args += ["--max-seq-len", str(MAX_SEQ_LEN), "--prefill-len", str(PREFILL_LEN)]
    shared, twin = tmp_path / "shared", tmp_path / "twin"
    run_cli("composite.export", *args, "--output", str(shared), check=True)
    run_cli("composite.export", *args, "--no-weight-sharing", "--output", str(twin), check=True)
    shared_shard, twin_shard = (manifest_schema.read(f)["shards"][1] for f in (shared, twin))
    assert (shared_shard["weight_sharing"], twin_shard["weight_sharing"]) == (True, False)
    for shard in (shared_shard, twin_shard):  # read from the program: one QNN graph per method
        assert shard["delegates"] == {method: {"QnnBackend": 1} for method in ("decode", "prefill", "verify")}
    assert shared_shard["size"] <= 0.45 * twin_shard["size"]  # one copy of the weights, not three
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


@pytest.mark.parametrize(
    ("qnn", "phrase"),
    [
        (
            "{soc: SM8350, precision: 16a4w_block}",
            "qnn precision 16a4w_block needs an HTP of v69 or newer; SM8350's is v68",
        ),
        ("{soc: SM8450, precision: 16a16w}", "qnn precision 16a16w needs an HTP of v73 or newer; SM8450's is v69"),
        ("{soc: SM8350, precision: 16a8w, overrides: {output: 16a4w_block}}", "16a4w_block needs an HTP of v69"),
        ("{precision: 16a4w_block, block_size: 48}", "qnn block_size must be one of 16, 32, 64 input channels, got 48"),
        ("{precision: 16a4w_block, rounding: stochastic}", "qnn rounding must be one of nearest, gptq"),
    ],
)
def test_a_precision_the_socs_htp_cannot_run_or_a_bad_block_is_refused(tmp_path, qnn, phrase):
    config = tmp_path / "c.yaml"
    config.write_text(f"shards: 3\nplacement: [xnnpack, qnn, xnnpack]\nqnn: {qnn}\n")
    result = export_error("--config", str(config), "--output", str(tmp_path / "out"))
    assert_clean_failure(result, phrase, output=tmp_path / "out")


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
def test_qnn_export_and_runners_show_only_our_own_lines(qnn_ready, workdir, precision):
    made = qnn_fp16_cli(workdir) if precision == "fp16" else qnn_quantized_cli(workdir, precision)
    out = made.folder
    pieces = [p.strip() for line in made.stderr.split("\n") for p in line.split("\r") if p.strip()]
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


def tiny_htp_graph(precision: str = "16a4w"):
    """The tiny default's middle shard (of 3) in HTP form, traced for a 4-position prefill, with
    example inputs and the QNN export options of `precision`."""
    from composite.lowering.qnn.htp_graph import QUANTIZED_MASK_FLOOR, htp_form
    from composite.model.default import load_default
    from composite.placement_options import DEFAULT_OPTIONS
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule, shard_io

    model = load_default().model.eval()
    spec = plan_shards(model.args, 3, None)[1]
    inputs, _ = shard_io(model.args, spec, 4, 32)
    with torch.random.fork_rng():  # the same inputs whatever ran before (example() draws from the global RNG)
        torch.manual_seed(0)
        example = tuple(t.example() for t in inputs)
    htp = htp_form(ShardModule(model, spec).eval(), 36, linear_as_conv=True, mask_floor=QUANTIZED_MASK_FLOOR)
    graph = torch.export.export(htp.eval(), example, strict=False).module()
    return graph, example, {**DEFAULT_OPTIONS["qnn"], "precision": precision}


def perturbed(example: tuple, seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return tuple(t + 0.1 * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t for t in example)


def test_linear_time_observers_prepare_the_same_graph(qnn_ready):
    """prepare_pt2e with its quadratic name search and argument copies removed gives the graph,
    observers and (after the same inputs) observed ranges that the stock prepare_pt2e gives."""
    import copy

    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from composite.lowering.qnn.quantizer import quantizer_for
    from composite.lowering.upstream_patches import linear_time_observers

    graph, example, options = tiny_htp_graph()
    stock = prepare_pt2e(copy.deepcopy(graph), quantizer_for(options))
    with linear_time_observers():
        fast = prepare_pt2e(graph, quantizer_for(options))
    assert fast.code == stock.code
    observers = [(name, type(m).__name__) for name, m in fast.named_modules()]
    assert observers == [(name, type(m).__name__) for name, m in stock.named_modules()]
    assert any(kind == "ConcatObserver" for _, kind in observers)
    call = perturbed(example, 0)
    with torch.no_grad():
        fast(*call)
        stock(*call)
    ranges, expected = fast.state_dict(), stock.state_dict()
    assert ranges.keys() == expected.keys()
    assert all(torch.equal(ranges[k], expected[k]) for k in ranges)


def converted_outputs(precision: str, pointwise_as_matmul: bool = True) -> tuple[list, list]:
    """(convert_pt2e's outputs, the tuner's faster_fake_quant's) on held-out inputs, for the tiny
    HTP graph quantized at `precision` after three calibration calls."""
    import copy

    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from composite.lowering.qnn.quantizer import quantizer_for
    from composite.lowering.upstream_patches import linear_time_observers
    from composite.tune import sensitivity

    graph, example, options = tiny_htp_graph(precision)
    with linear_time_observers():
        prepared = prepare_pt2e(graph, quantizer_for(options))
    with torch.no_grad():
        for seed in range(3):
            prepared(*perturbed(example, seed))
        converted = convert_pt2e(prepared)
        pointwise = sensitivity._is_pointwise
        if not pointwise_as_matmul:
            sensitivity._is_pointwise = lambda graph, node: False
        try:
            faster = sensitivity.faster_fake_quant(copy.deepcopy(converted))
        finally:
            sensitivity._is_pointwise = pointwise
        targets = [node.target for node in faster.graph.nodes]
        assert torch.ops.quantized_decomposed.quantize_per_tensor.default not in targets
        assert torch.ops.quantized_decomposed.dequantize_per_channel.default not in targets
        assert torch.ops.torchao.dequantize_affine.default not in targets  # block weights: constants too
        pairs = sum(
            n.target == torch.ops.quantized_decomposed.quantize_per_tensor.default for n in converted.graph.nodes
        )
        assert targets.count(sensitivity.fake_quant) < 0.8 * pairs  # those of reshapes, slices, cats... are gone
        call = perturbed(example, 7)
        return [t.clone() for t in converted(*call)], [t.clone() for t in faster(*call)]


@pytest.mark.parametrize("precision", ["16a4w", "8a8w", "16a4w_block"])
def test_the_tuners_fake_quant_graph_computes_what_the_converted_one_does(qnn_ready, precision):
    """composite.tune's faster_fake_quant: fused quantize/dequantize pairs, those of values already
    on their grid dropped, constant weights: the outputs of convert_pt2e's graph, bit for bit at 8
    bits; 1x1 convolutions as matrix products sum in another order, so with them (the tuner's
    graph) a 16-bit output lands a step away now and then (> 60 dB), and so may an 8-bit one on
    some inputs (docs/tune.md)."""
    from composite.lowering.calibration import sqnr_db

    expected, actual = converted_outputs(precision)
    assert all(sqnr_db(e, a) > 60 for e, a in zip(expected, actual))
    if precision == "8a8w":
        expected, actual = converted_outputs(precision, pointwise_as_matmul=False)
        assert all(torch.equal(e, a) for e, a in zip(expected, actual))


def test_a_precision_quantized_after_another_in_one_process_is_quantized_as_in_a_fresh_one(qnn_ready, tmp_path):
    """8a8w after 16a4w_block in this process gives, bit for bit, the converted graph's outputs a
    fresh process gives: nothing of one quantization leaks into the next."""
    converted_outputs("16a4w_block")
    here, _ = converted_outputs("8a8w")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from test_qnn import converted_outputs; "
        "torch.save(converted_outputs('8a8w')[0], sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", script, str(REPO / "tests"), str(tmp_path / "fresh.pt")], check=True)
    fresh = torch.load(tmp_path / "fresh.pt")
    assert len(here) == len(fresh) and all(torch.equal(a, b) for a, b in zip(here, fresh))


@pytest.mark.parametrize("precision", ["16a8w", "8a8w"])
def test_the_tuners_head_on_many_rows_is_the_decode_graph_row_by_row(qnn_ready, precision):
    """composite.tune builds the head's graph on prefill_len rows with every row's logits: fed the
    same rows as the export's one-row decode graph (a short block's padding repeating a real row), it observes
    the same ranges, so each row's quantized logits are the decode graph's (to float32 rounding of
    a matmul over more rows: an element now and then one step away, > 60 dB)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from composite.lowering.calibration import sqnr_db
    from composite.lowering.qnn.shard import QnnShardLowering
    from composite.manifest import DECODE
    from composite.model.default import load_default
    from composite.placement_options import DEFAULT_OPTIONS
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule

    model = load_default().model.eval()
    spec = plan_shards(model.args, 3, [0, model.args.n_layers, 0])[2]
    head = ShardModule(model, spec).eval()
    options = {**DEFAULT_OPTIONS["qnn"], "precision": precision, "weight_sharing": False}
    width, dim = 8, model.args.dim
    names = {DECODE: (["hidden", "logits_index"], ["logits"])}

    def lowering(rows: int):
        example = (torch.zeros(1, rows, dim),) + ((torch.arange(rows),) if rows > 1 else ())
        return QnnShardLowering(head, {DECODE: example}, names, options, 40)

    one, many = lowering(1), lowering(width)
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(1, width, dim, generator=generator) * 3 for _ in range(3)]
    real = [width, width, 5]
    for block, count in zip(blocks, real):
        many.observe(DECODE, (block[:, torch.arange(width).clamp(max=count - 1)], torch.arange(width)))
        for row in range(count):
            one.observe(DECODE, (block[:, row : row + 1],))
    one_graph, many_graph = convert_pt2e(one.graphs[DECODE]), convert_pt2e(many.graphs[DECODE])
    with torch.no_grad():
        probe = torch.randn(1, width, dim, generator=generator) * 3
        together = many_graph(probe, torch.arange(width))[0]
        row_by_row = torch.cat([one_graph(probe[:, row : row + 1])[0] for row in range(width)], dim=1)
    assert together.shape == row_by_row.shape == (1, width, model.args.vocab_size)
    assert sqnr_db(row_by_row, together) > 60
    # a range observed on other rows than the decode graph's would move whole rows' logits
    assert torch.equal(together.argmax(-1), row_by_row.argmax(-1))


def test_a_weight_shared_shard_compiles_without_its_float_weights_and_measures_its_twin_a_method_a_fork(
    qnn_ready, monkeypatch
):
    """The float weights are gone before the shard is compiled (convert_pt2e leaves them on its
    graphs, and torch's and torchao's device lookups cache every graph they see), and the unshared
    twin is compiled and measured one method at a time, each in a process of its own: what lower()
    returns is the forks'."""
    import gc
    import weakref

    from executorch.runtime import Runtime

    from composite.lowering.qnn.shard import QnnShardLowering
    from composite.manifest import DECODE, PREFILL
    from composite.model.default import load_default
    from composite.placement_options import DEFAULT_OPTIONS
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule, shard_io

    model = load_default().model.eval()
    spec = plan_shards(model.args, 3, None)[1]
    module = ShardModule(model, spec).eval()
    float_weights = [weakref.ref(p) for p in module.parameters()]
    io = {DECODE: shard_io(model.args, spec, 1, 32), PREFILL: shard_io(model.args, spec, 4, 32)}
    names = {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in io.items()}
    examples = {m: tuple(t.example() for t in inputs) for m, (inputs, _) in io.items()}
    options = {**DEFAULT_OPTIONS["qnn"], "precision": "16a4w", "weight_sharing": True}
    job = QnnShardLowering(module, examples, names, options, 36)
    for method, example in examples.items():
        job.observe(method, perturbed(example, 0))
    del model, module

    alive_at_compile = []
    compile_shard = QnnShardLowering._partitioned

    def partitioned(self, edge, spec, methods=None, weights_to=None):
        gc.collect()
        alive_at_compile.append(sum(ref() is not None for ref in float_weights))
        return compile_shard(self, edge, spec, methods, weights_to)

    monkeypatch.setattr(QnnShardLowering, "_partitioned", partitioned)

    def measure(buffer: bytes) -> tuple:
        return os.getpid(), len(buffer), sorted(Runtime.get().load_program(buffer).method_names)

    shard, _, context_bytes, measured = job.lower(measure)
    assert alive_at_compile == [0]  # this process's one compile (the twin's are the forks')
    pids, sizes, methods = zip(*measured)
    assert methods == ([DECODE], [PREFILL])
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert sum(sizes) > len(shard.buffer) > context_bytes > 0  # the twin holds the weights once per method


def test_qnn_preprocess_takes_a_partition_without_a_copy_of_its_weights(qnn_ready):
    """ExecuTorch deep-copies a partition's program for the backend's preprocess; inside
    lean_preprocess the copy has a graph of its own and the same weight tensors, and outside it
    ExecuTorch's own copy is back."""
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend

    from composite.lowering.upstream_patches import lean_preprocess

    program = torch.export.export(torch.nn.Linear(64, 32), (torch.randn(1, 64),))
    with lean_preprocess():
        copied = QnnBackend.copy_exported_program_for_preprocess(program, [])
    assert copied.graph_module is not program.graph_module
    assert copied.state_dict["weight"] is program.state_dict["weight"]
    assert "copy_exported_program_for_preprocess" not in vars(QnnBackend)
    copied = QnnBackend.copy_exported_program_for_preprocess(program, [])
    assert copied.state_dict["weight"].data_ptr() != program.state_dict["weight"].data_ptr()


def mapped_files(tensor: torch.Tensor) -> list[str]:
    """The files this process maps where the tensor's data is (/proc/self/maps)."""
    address, files = tensor.data_ptr(), []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end and len(fields) == 6 and fields[5].startswith("/"):
            files.append(fields[5])
    return files


def test_qnn_compiles_with_the_weights_on_disk(qnn_ready, tmp_path):
    """When QNN compiles, its wrappers hold their own copies of the weights: the tensors of the
    program it was given are by then read from a file in the folder given (unlinked), with the
    same values. The same context binary as without (each compiled in a fork: a process numbers
    its compiles inside the binary)."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as qnn_manager
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend
    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn

    from composite.executor.fork import ForkedCall
    from composite.lowering.qnn.pte import qnn_backend_modules
    from composite.lowering.qnn.shard import compile_spec
    from composite.lowering.upstream_patches import lean_preprocess
    from composite.placement_options import DEFAULT_OPTIONS

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128).eval()  # its weight 128 KB, its bias 512 bytes
    example = (torch.randn(1, 256),)
    values = {name: t.detach().clone() for name, t in model.state_dict().items()}
    spec = compile_spec({**DEFAULT_OPTIONS["qnn"], "precision": "fp16", "weight_sharing": False})

    def lowered(weights_to):  # run in a fork: the patches below end with it
        given, at_compile = [], []
        build = QnnBackend._build_op_wrappers

        def building(program, *args):
            weights = {name.removeprefix("_"): t for name, t in program.state_dict.items()}  # what QNN is given
            given.append(weights)
            return build(program, *args)

        compile_ = qnn_manager.QnnManager.Compile

        def spy(manager, *args):
            at_compile.append({name: (mapped_files(t), torch.equal(t, values[name])) for name, t in given[-1].items()})
            return compile_(manager, *args)

        QnnBackend._build_op_wrappers = staticmethod(building)
        qnn_manager.QnnManager.Compile = spy
        with lean_preprocess(weights_to):
            edge = to_edge_transform_and_lower_to_qnn(model, example, spec)
        return qnn_backend_modules(edge)[0].processed_bytes[12:], at_compile

    binary, (tensors,) = ForkedCall(lowered, (str(tmp_path),)).result()
    files = {name: files for name, (files, _) in tensors.items()}
    assert len(files["weight"]) == 1  # the bias is below 64 KB and stays where it is
    assert files["weight"][0].startswith(f"{tmp_path}/composite-qnn-weights-")
    assert files["weight"][0].endswith(" (deleted)") and not list(tmp_path.iterdir())
    assert files["bias"] == []
    assert all(equal for _, equal in tensors.values())
    unchanged, (tensors,) = ForkedCall(lowered, (None,)).result()
    assert all(files == [] for files, _ in tensors.values())
    assert binary == unchanged


def lpbq_shard_against_its_graph(monkeypatch) -> tuple[float, float]:
    """(SQNR in dB of the simulator's output of a 16a4w_block shard against its converted graph's,
    on the decode and prefill methods' held-out inputs)."""
    from executorch.runtime import Runtime

    from composite.lowering.calibration import sqnr_db
    from composite.lowering.qnn.shard import QnnShardLowering
    from composite.manifest import DECODE, PREFILL
    from composite.model.default import load_default
    from composite.placement_options import DEFAULT_OPTIONS
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule, shard_io

    model = load_default().model.eval()
    spec = plan_shards(model.args, 3, None)[1]
    module = ShardModule(model, spec).eval()
    io = {DECODE: shard_io(model.args, spec, 1, 32), PREFILL: shard_io(model.args, spec, 4, 32)}
    names = {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in io.items()}
    examples = {m: tuple(t.example() for t in inputs) for m, (inputs, _) in io.items()}
    options = {**DEFAULT_OPTIONS["qnn"], "precision": "16a4w_block", "weight_sharing": False, "native_io": False}
    job = QnnShardLowering(module, examples, names, options, 36)
    for seed in range(4):
        for method, example in examples.items():
            job.observe(method, perturbed(example, seed))
    probes = {method: perturbed(example, 9) for method, example in examples.items()}
    expected = {}
    edge = QnnShardLowering._edge

    def outputs_then_edge(self, graphs):  # the converted graphs, on their way to the HTP
        with torch.no_grad():
            expected.update({m: graph(*probes[m])[0] for m, graph in graphs.items()})
        return edge(self, graphs)

    monkeypatch.setattr(QnnShardLowering, "_edge", outputs_then_edge)
    shard, _, _, _ = job.lower(lambda buffer: None)
    program = Runtime.get().load_program(shard.buffer)
    return tuple(sqnr_db(expected[m], program.load_method(m).execute(list(probes[m]))[0]) for m in (DECODE, PREFILL))


def test_a_16a4w_block_shard_on_the_simulator_computes_its_quantized_graph(qnn_ready, monkeypatch):
    """LPBQ's block scales are put on the HTP's grid before the weights are rounded with them
    (composite/lowering/qnn/lpbq.py): the simulator then computes what the converted graph in PyTorch
    does, within what 16-bit activations round differently in another order of operations (above
    60 dB). With ExecuTorch's own block scales, which its QNN builder rounds to that grid after the
    weights were rounded with them, the simulator computes another function: 32-33 dB measured
    (docs/placement.md), so the bound fails when the scales leave the grid. (That second shard is
    not lowered here: a QNN lowering is a CI minute.)"""
    sqnr = lpbq_shard_against_its_graph(monkeypatch)
    assert min(sqnr) > 60, sqnr


@pytest.mark.parametrize("samples", [16, 64, 128])
def test_calibration_decodes_a_sequence_from_its_start_bos_first(samples):
    """composite.eval and --eval_text feed a shard every token through its decode method, the first
    (a trained model's largest activations) too: the decode calls include position 0 with the BOS,
    whatever the number of prefill calls, and add up to the decode budget."""
    from composite.lowering.calibration import DEFAULT_DECODE_SAMPLES, calibration_calls
    from composite.manifest import DECODE, PREFILL

    bos = 1
    calls = calibration_calls({"samples": samples}, None, 512, {DECODE: 1, PREFILL: 32}, 256, bos)
    decode = [c for c in calls if c.method == DECODE and not c.held_out]
    prefill = [c for c in calls if c.method == PREFILL and not c.held_out]
    assert decode[0].pos == 0 and decode[0].tokens == (bos,) and decode[0].starts_sequence
    assert len(decode) == min(samples, DEFAULT_DECODE_SAMPLES) * 32 and len(prefill) == samples
    assert all(c.tokens[0] == bos for c in prefill if c.pos == 0)
    assert {c.pos for c in decode} >= set(range(32))  # the opening sequence's first positions
