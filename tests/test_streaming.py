"""The export streams: a lowering job reads its shard's weights one unit (embedding, layer, head) at a
time, and the .pte files are byte for byte what lowering each shard of the whole model in memory
gives. Cut by the HTP's budget, refusals before any work, a lowering process that dies, resuming."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref

import pytest

from composite.model.weights import WeightSource
from conftest import REPO, assert_clean_failure, lower_here, run_cli

MB = 1 << 20


class CountingWeights(WeightSource):
    """Another source's tensors, counting the float bytes read and still alive (each storage's
    finalizer says when it is gone)."""

    def __init__(self, inner: WeightSource):
        super().__init__(inner.shapes, inner.where)
        self.inner, self.permuted = inner, inner.permuted
        self.alive = self.peak = self.total = 0

    def read(self, names):
        tensors = self.inner.read(names)
        for tensor in tensors.values():
            size = tensor.untyped_storage().nbytes()
            self.alive += size
            self.total += size
            self.peak = max(self.peak, self.alive)
            weakref.finalize(tensor.untyped_storage(), self._freed, size)
        return tensors

    def _freed(self, size: int) -> None:
        self.alive -= size

    def _read(self, names):  # read() is overridden whole
        return self.inner._read(names)

    def _hash(self, names):
        return self.inner._hash(names)


def lower_each_job_alone(loaded, config) -> list[tuple[int, int, bytes]]:
    """(peak float bytes alive, float bytes read, .pte bytes) of each shard's lowering job, run in
    this process one after another, each counted alone."""
    source, measured = loaded.weights, []
    for index in range(config.shards):
        loaded.weights = counting = CountingWeights(source)
        buffer = lower_here(loaded, config, index)
        measured.append((counting.peak, counting.total, buffer))
    loaded.weights = source
    return measured


def whole_model_lowering(checkpoint: str | None, config, index: int) -> bytes:
    """What lowering shard `index` of the whole model in memory gives (the exporter before streaming):
    every weight read and rotated at once, the shard quantized as a whole."""
    from composite.lowering import embedding, xnnpack
    from composite.lowering.program import finish
    from composite.manifest import every_row_logits
    from composite.model.checkpoint import load_checkpoint
    from composite.model.rotation import rotate
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule, shard_io

    model = load_checkpoint(checkpoint, None).model
    rotate(model, config.rotation())
    spec = plan_shards(model.args, config.shards)[index]
    module = ShardModule(model, spec).eval()
    io = {
        m: shard_io(model.args, spec, n, config.max_seq_len, every_row_logits(m)) for m, n in config.methods().items()
    }
    names = {m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in io.items()}
    examples = {m: tuple(t.example() for t in inputs) for m, (inputs, _) in io.items()}
    notes = []
    if spec.has_embedding and config.embedding_bits_and_group():
        bits, group = config.embedding_bits_and_group()
        notes = embedding.quantize(module, bits, group, config.shards - 1, model.args.tie_embeddings)
    edge, lowering_notes, _ = xnnpack.lower_module(module, examples, names, config.placements()[index].options)
    return finish(edge, lowering_notes + notes).buffer


# One case lowers every kind of unit a streamed job reads: a quantized embedding table, layers of
# more than one in a shard, and a head tied to the table, in a model the export rotates; the other
# is the embedded default (tied too) in fp32.
STREAMED_CASES = [
    pytest.param(
        {
            "shards": 2,
            "xnnpack": {"quantize": "8da4w"},
            "embedding_quantize": "4,32",
            "rotate": "hadamard-ffn",
            "small": True,
        },
        id="tied-rotated-8da4w-emb4",
    ),
    pytest.param({"shards": 2, "xnnpack": {"quantize": "none"}}, id="fp32"),
]


@pytest.mark.parametrize("case", STREAMED_CASES)
def test_a_lowering_job_holds_one_units_float_weights_at_a_time(small_checkpoint, case):
    """A quantized shard's float weights go unit by unit (only the embedding, the head and one layer
    are ever alive); an fp32 shard's stay, its own and no more. (What a job leaves alive in its
    process, torch.export's process-wide maps pin the last graphs and their constants, goes with
    the process: every lowering job gets one of its own.) Each streamed .pte is byte for byte what
    lowering its shard from the whole model in memory gives."""
    from composite.config import build_config
    from composite.model.checkpoint import load_checkpoint
    from composite.split.plan import plan_shards, unit_bytes

    case = dict(case)
    checkpoint = str(small_checkpoint) if case.pop("small", False) else None
    config = build_config(None, {"max_seq_len": 32, "prefill_len": 8, "checkpoint": checkpoint, **case})
    quantized = config.placements()[0].options["quantize"] != "none"
    loaded = load_checkpoint(checkpoint, None)
    units = unit_bytes(loaded.args)  # [embedding, layers..., head], float32 bytes
    specs = plan_shards(loaded.args, config.shards)
    assert any(len(spec.layers) > 1 for spec in specs)
    for spec, (peak, read, streamed) in zip(specs, lower_each_job_alone(loaded, config)):
        own = units[0] * spec.has_embedding + sum(units[1 + i] for i in spec.layers) + units[-1] * spec.has_head
        assert read >= own - loaded.args.dim  # every tensor of the shard read (the final norm counts in the head)
        assert peak <= own
        if quantized:
            norms = len(spec.layers) * 2 * loaded.args.dim * 4  # not quantized: every layer's stay
            assert peak <= units[0] * spec.has_embedding + units[1] + units[-1] * spec.has_head + norms
        assert streamed == whole_model_lowering(checkpoint, config, spec.index), f"shard {spec.index}"


def test_auto_cut_fills_the_npu_shards_up_to_their_budget():
    from composite.config import build_config
    from composite.export import plan
    from composite.model.default import DEFAULT_ARGS
    from composite.split.htp_limits import estimate
    from composite.split.plan import ShardSpec
    from composite.units import MIB as HTP_MB

    placement = ["xnnpack", "qnn", "qnn", "qnn", "qnn", "xnnpack"]

    def cut(budget_mb: float) -> list[int]:
        config = build_config(
            None,
            {"shards": 6, "placement": placement, "layers_per_shard": "auto", "qnn": {"max_context_mb": budget_mb}},
        )
        specs = plan(DEFAULT_ARGS, config, config.placements())
        return [len(s.layers) for s in specs]

    assert cut(1024) == [0, 2, 2, 1, 1, 0]  # all 6 layers on the NPU, spread evenly
    options = build_config(None, {"shards": 6, "placement": placement}).placements()[1].options
    one = (
        estimate(DEFAULT_ARGS, ShardSpec(1, 0, 1, False, False), options, 512, build_config(None, {}).methods()).total
        / HTP_MB
    )
    assert cut(one * 1.5) == [1, 1, 1, 1, 1, 1]  # one layer each; the CPU ends take the rest
    from composite.errors import UserError

    with pytest.raises(UserError, match="one decoder layer alone does not fit NPU shard 1"):
        cut(one / 2)


def test_a_qnn_shard_over_its_htp_budget_is_refused_before_any_work(tmp_path):
    output = tmp_path / "out"
    args = [
        "--shards",
        "3",
        "--placement",
        "xnnpack,qnn,xnnpack",
        "--layers-per-shard",
        "1,4,1",
        "--output",
        str(output),
    ]
    config = tmp_path / "budget.yaml"
    config.write_text("qnn: {max_context_mb: 0.5}\n")
    result = run_cli("composite.export", "--config", str(config), *args)
    assert_clean_failure(
        result, "QNN shard 1 (4 layers at fp16) needs about", "more than qnn.max_context_mb", output=output
    )


def test_a_shard_that_cannot_fit_the_memory_allowed_is_refused_up_front(tmp_path):
    output = tmp_path / "out"
    result = run_cli("composite.export", "--shards", "2", "--max-memory", "0.1", "--output", str(output))
    assert_clean_failure(result, "shard 0 is expected to need about", "more than the 0.1 GB", output=output)


def children_of(pid: int) -> list[int]:
    from composite.memory import descendants

    return [p for p in descendants(pid) if p != pid]


def start_export(output, cache, checkpoint) -> subprocess.Popen:
    env = {**os.environ, "COMPOSITE_CACHE": str(cache), "COMPOSITE_EXPORT_WORKERS": "1"}
    args = [
        "--checkpoint",
        str(checkpoint),
        "--shards",
        "3",
        "--quantize",
        "none",
        "--max-seq-len",
        "40",
        "--prefill-len",
        "8",
        "--output",
        str(output),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "composite.export", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_lowering_process_that_dies_ends_the_export_in_one_line(tmp_path, small_checkpoint):
    output = tmp_path / "out"
    export_process = start_export(output, "off", small_checkpoint)
    child = wait_for(lambda: children_of(export_process.pid))[0]
    os.kill(child, signal.SIGKILL)
    _, err = export_process.communicate(timeout=120)
    assert export_process.returncode == 1, err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "lowering shard 0:" in line and "killed by signal 9 (SIGKILL)" in line and "out-of-memory" in line, line
    assert "at their peak" in line and "nothing was written" in line
    assert not output.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_an_export_stopped_midway_keeps_its_finished_shards_and_resumes(tmp_path, small_checkpoint):
    cache, output = tmp_path / "cache", tmp_path / "out"
    first = start_export(output, cache, small_checkpoint)
    wait_for(lambda: list(cache.glob("??/*/shard.pte")))  # the first shard is stored as soon as it is done
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode != 0 and not output.exists()
    assert "nothing was written; the shards lowered so far are in the shard cache: the same command resumes" in err
    stored = len(list(cache.glob("??/*/shard.pte")))
    assert 1 <= stored < 3
    second = start_export(output, cache, small_checkpoint)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert f"3 shards ({stored} of them from the cache)" in out
