"""Qualcomm QNN HTP: fp16 or quantized (16a4w, 16a8w, 8a8w, 16a16w) shards, optionally leaving
chosen ops to XNNPACK inside the same .pte.

The shard is first rewritten into its HTP-friendly form (htp_graph.py). Quantized precisions are
calibrated with the shard's real inputs (the float model's, as calibration.py replays them) and
converted with ExecuTorch's QnnQuantizer (qnn_quantizer.py) through torchao's pt2e flow. Every QNN
program is compiled with multi-context enabled, each with the spill-fill size it needs itself; the
export then writes the largest of them into every QNN shard (composite/spill_fill.py). The lowered
program's QNN payloads are edited by qnn_pte.py; upstream_patches.py keeps the lowering's time and
memory down.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from composite import qnn_host
from composite.errors import UserError
from composite.executor.fork import ForkedCall
from composite.lowering import native_io
from composite.lowering.calibration import ShardReplay, has_block_weights
from composite.lowering.program import BackendLowering, LoweredProgram, finish
from composite.lowering.qnn import weight_rounding
from composite.lowering.qnn.held_out import held_out_pass, measure
from composite.lowering.qnn.htp_graph import QUANTIZED_MASK_FLOOR, htp_form
from composite.lowering.qnn.pte import content_signatures, context_bytes, own_spill_fill
from composite.lowering.qnn.quantizer import quantizer_for
from composite.lowering.upstream_patches import forget_cached_modules, lean_preprocess, linear_time_observers
from composite.lowering.work import ShardWork, load_shard


def compile_spec(options: dict):
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    backend = generate_htp_compiler_spec(
        use_fp16=options["precision"] == "fp16",
        use_multi_contexts=True,
        use_weight_sharing=options.get("weight_sharing", True),
    )
    return generate_qnn_executorch_compiler_spec(
        soc_model=getattr(QcomChipset, options["soc"]), backend_options=backend
    )


def traced_htp(module, example_inputs: dict, options: dict, n_positions: int) -> dict:
    """method -> the shard's HTP form traced by torch.export: where a quantized precision starts.
    Several precisions of one shard can start from one trace (QnnShardLowering's `traced`)."""
    htp = htp_form(
        module,
        n_positions,
        linear_as_conv="aten.linear.default" not in skipped_op_set(options),
        mask_floor=QUANTIZED_MASK_FLOOR,
    ).eval()
    with torch.no_grad():
        return {
            method: torch.export.export(htp, inputs, strict=False).module() for method, inputs in example_inputs.items()
        }


class QnnShardLowering:
    """One QNN shard through the three steps an export interleaves across shards:
    built (HTP-friendly form; for quantized precisions also observers inserted per method), then
    calibrated (the export feeds `observers` the shard's real inputs), then `lower`ed."""

    def __init__(
        self, module, example_inputs: dict, names: dict, options: dict, n_positions: int, traced: dict | None = None
    ):
        """names: method -> (input names, output names), as the manifest lists them.
        n_positions: how many rotary positions the shard can be asked for, the cache length plus
        the widest call (the padded tail of a last prefill chunk sits past the cache).
        traced: traced_htp() of this module with these options, to copy instead of tracing again."""
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

        qnn_host.activate()  # fails early, with one line, when this process cannot lower QNN shards
        self.example_inputs, self.names, self.options = example_inputs, names, options
        # method -> ("in" | "out", name) -> Encoding of each native I/O tensor (quantized: set by lower())
        self.io_encodings: dict[str, dict] = {method: {} for method in example_inputs}
        self.skip_ops = skipped_op_set(options)
        self.skip_ids = set(options.get("skip_node_ids") or [])
        self.calibrated = {method: 0 for method in example_inputs}
        self.moments = None  # GPTQ's input statistics (round_weights), while calibrating
        if options["precision"] == "fp16":
            htp = htp_form(module, n_positions, linear_as_conv="aten.linear.default" not in self.skip_ops).eval()
            if self.native_io:
                htp = native_io.HalfIO(htp, has_head=next(iter(names.values()))[1][0] == "logits")
                self.example_inputs, self.io_encodings = native_io.half_io(names, example_inputs)
            self.graphs = {method: htp for method in example_inputs}
            return
        if traced is None:
            traced = traced_htp(module, example_inputs, options, n_positions)
        else:
            traced = {method: copy.deepcopy(graph) for method, graph in traced.items()}  # prepare_pt2e changes it
        self.graphs = {}
        for method, graph in traced.items():
            with linear_time_observers():
                self.graphs[method] = prepare_pt2e(graph, quantizer_for(options))
        # GPTQ rounding of block-wise 4-bit weights needs their inputs' second moments: summed while calibrating
        if has_block_weights(options):
            self.moments = weight_rounding.watch_inputs(self.graphs)

    @property
    def quantized(self) -> bool:
        return self.options["precision"] != "fp16"

    @property
    def native_io(self) -> bool:
        return self.options.get("native_io", True)

    def io_observers(self, method: str) -> dict:
        """("in" | "out", name) -> observer of each I/O tensor that will be quantized."""
        if not (self.quantized and self.native_io):
            return {}
        return native_io.io_observers(self.graphs[method], *self.names[method])

    def share_io_ranges(self, hidden_out: dict[str, tuple[float, float]]) -> None:
        """One range per layer cache (its input and new-entry output, in every method); the hidden
        state out of the shard gets `hidden_out` (method -> (min, max))."""
        caches: dict[tuple, list] = {}
        for method in self.graphs:
            for (side, name), observer in self.io_observers(method).items():
                if name == "hidden":
                    if side == "out" and method in hidden_out and hasattr(observer, "min_val"):
                        low, high = hidden_out[method]
                        observer.min_val.fill_(low)
                        observer.max_val.fill_(high)
                else:
                    caches.setdefault((name.split("_")[0], name.split(".")[1]), []).append(observer)
        native_io.share_ranges(list(caches.values()))

    def round_weights(self) -> None:
        """After the last calibration input: each 4-bit weight rounded by its inputs (GPTQ), where the
        options ask for it (weight_rounding.py); the prepared graphs then convert to those integers."""
        if self.moments is not None:
            weight_rounding.stop_watching(self.graphs, self.moments)
            weight_rounding.round_weights(self.graphs, self.moments)
            self.moments = None

    def observe(self, method: str, inputs):
        """One calibration input (quantized precisions only); -> the graph's outputs (the float
        shard's, as the observers leave values as they are)."""
        with torch.no_grad():
            outputs = self.graphs[method](*inputs)
        self.calibrated[method] += 1
        return outputs

    def lower(
        self, measure: Callable[[bytes], tuple], weights_to: str | None = None
    ) -> tuple[LoweredProgram, int, int, list]:
        """-> (the lowered shard, whose contexts carry the spill-fill size they need, that size,
        the bytes of its context binaries, [measure(.pte bytes)] of what runs on this host: one
        item a program, each measuring the methods it has). XNNPACK takes what QNN is told to
        skip. A weight-shared shard cannot run on the x86 simulator: its twin without weight
        sharing (same graphs, same quantization) is compiled and measured instead, one method at
        a time, each in a forked process before the shard's own compile, so that neither
        compile's leftovers (memory the process keeps after it) lie
        under the other's peak, and a twin method's compile (half the shard's) stays below the
        shard's. The prepared graphs, and the float weights they hold, are let go as each is
        converted: compiling is where a QNN shard needs the most memory. weights_to: a folder on
        disk where the weights wait while the shard compiles (lean_preprocess; not the twin's:
        a fork's weights are its parent's pages)."""
        missing = [method for method, count in self.calibrated.items() if count == 0]
        if self.quantized and missing:
            raise UserError(
                f"no calibration inputs reached the {', '.join(missing)} method of a "
                f"{self.options['precision']} QNN shard"
            )
        self.round_weights()
        graphs, self.graphs = self.graphs, None
        if self.quantized:
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            graphs = {method: without_unused_tensors(convert_pt2e(graphs.pop(method))) for method in list(graphs)}
            forget_cached_modules()
            share_equal_constants(graphs)
            if self.native_io:
                self.io_encodings = {m: native_io.read_params(g, *self.names[m]) for m, g in graphs.items()}
        notes = []
        if self.quantized:
            notes.append("calibrated with " + ", ".join(f"{n} {m} inputs" for m, n in self.calibrated.items()))
        if self.skip_ops or self.skip_ids:
            notes.append(
                f"left to XNNPACK: ops {sorted(self.skip_ops) or '-'}, node ids {sorted(self.skip_ids) or '-'}"
            )
        # Decomposing and QNN's edge passes, most of a shard's lowering time, are made once: they
        # do not depend on weight sharing, so the twin and the shard share them.
        edge = self._edge(graphs)
        del graphs
        measured = []
        if self.options["weight_sharing"]:
            notes.append("weights shared by its methods; SQNR measured on its unshared twin (same graphs)")
            measured = [ForkedCall(self._measured_twin, (edge, method, measure)).result() for method in self.names]
        partitioned = self._partitioned(edge, compile_spec(self.options), weights_to=weights_to)
        del edge
        content_signatures(partitioned)
        own, context = own_spill_fill(partitioned), context_bytes(partitioned)
        shard = finish(partitioned, notes, self.planning())
        del partitioned
        return shard, own, context, measured or [measure(shard.buffer)]

    def _measured_twin(self, edge, method: str, measure: Callable[[bytes], tuple]) -> tuple:
        """measure() of `method` of the shard compiled without weight sharing (run in a forked
        process: it partitions `edge` in place)."""
        from executorch.exir import EdgeProgramManager

        alone = EdgeProgramManager({method: edge.exported_program(method)}, None, edge.compile_config)
        unshared = self._partitioned(alone, compile_spec({**self.options, "weight_sharing": False}), [method])
        content_signatures(unshared)  # its contexts (one a QNN partition) told apart by content, not by the clock
        return measure(finish(unshared, [], self.planning()).buffer)

    def _positions(self, method: str) -> tuple[dict, dict]:
        """(input position -> dtype, output position -> dtype) of the method's quantized I/O (a
        float16 graph has its I/O dtypes already)."""
        inputs, outputs = self.names[method]
        quantized = {key: e for key, e in self.io_encodings[method].items() if e.quantized}
        return (
            {i: quantized[("in", n)].dtype for i, n in enumerate(inputs) if ("in", n) in quantized},
            {i: quantized[("out", n)].dtype for i, n in enumerate(outputs) if ("out", n) in quantized},
        )

    def planning(self) -> dict | None:
        """Per-method memory planning that gives the quantized I/O tensors their dtypes (None: no
        quantized I/O)."""
        if not any(e.quantized for encodings in self.io_encodings.values() for e in encodings.values()):
            return None
        return {method: native_io.planning_pass(*self._positions(method)) for method in self.names}

    def _edge(self, graphs: dict):
        """The methods' edge programs as to_edge_transform_and_lower makes them before it
        partitions: decomposed but for the ops QNN keeps whole, then through QNN's edge passes."""
        from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
        from executorch.backends.qualcomm.utils.utils import qnn_edge_config
        from executorch.exir.program._program import _gen_edge_manager_for_partitioners, lift_constant_tensor_pass

        spec = compile_spec(self.options)
        programs, passes = {}, {}
        for method, graph in graphs.items():
            with torch.no_grad():
                exported = torch.export.export(graph, self.example_inputs[method], strict=False)
            pass_manager = get_qnn_pass_manager_cls()()
            programs[method] = pass_manager.transform_for_export_pipeline(exported)
            job = pass_manager.get_capture_program_passes()
            if any(self._positions(method)):  # the QNN graph takes and gives these tensors quantized
                from executorch.backends.qualcomm._passes import TagQuantIO
                from executorch.backends.qualcomm.utils.constants import (
                    QCOM_PASS_ACTIVATE_KEY,
                    QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY,
                )

                user_inputs = list(exported.graph_signature.user_inputs)
                job[TagQuantIO][QCOM_PASS_ACTIVATE_KEY] = True
                job[TagQuantIO][QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY]["get_quant_io_dtype_fn"] = native_io.tag_function(
                    user_inputs, *self._positions(method)
                )
            passes[method] = pass_manager.get_to_edge_transform_passes(
                exported,
                passes_job=job,
                compiler_specs=spec,
                skip_node_id_set=self.skip_ids,
                skip_node_op_set=self.skip_ops,
            )
        # ExecuTorch's own first step of to_edge_transform_and_lower (which has no public form that
        # stops before partitioning); the QNN partitioner tells it which ops to keep whole.
        edge = _gen_edge_manager_for_partitioners(
            {method: self._partitioners(spec) for method in graphs}, programs, qnn_edge_config(), None, False
        )
        edge = edge.transform(passes)
        for method in graphs:
            lift_constant_tensor_pass(edge.exported_program(method))
        return edge

    def _partitioners(self, spec) -> list:
        from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners = [QnnPartitioner(spec, skip_node_id_set=self.skip_ids, skip_node_op_set=self.skip_ops)]
        if self.skip_ops or self.skip_ids:
            partitioners.append(XnnpackPartitioner())
        return partitioners

    def _partitioned(self, edge, spec, methods: list[str] | None = None, weights_to: str | None = None):
        """`edge` with QNN's part compiled for `spec` (and what QNN skips given to XNNPACK). One
        context holds every method's graph (ExecuTorch's multi-method preprocess); with weight
        sharing in the spec, they hold one copy of the weights between them. methods: the
        manifest's (edge.methods is a set), unless `edge` holds fewer. weights_to: lean_preprocess's."""
        from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

        methods = methods or list(self.example_inputs)
        # a partitioner instance per method, as to_edge_transform_and_lower has them: QNN's
        # collects the partition tags of every program it is given
        partitioners = {method: self._partitioners(spec) for method in methods}
        with QnnManagerContext({method: spec for method in methods}), lean_preprocess(weights_to):
            for step in range(len(partitioners[methods[0]])):
                edge = edge.to_backend({method: partitioners[method][step] for method in methods})
        return edge


def without_unused_tensors(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph` without the parameters and buffers its nodes no longer read. convert_pt2e folds each
    weight's quantization into a new constant and leaves the float weight on the module: a float32
    copy of the shard that would stay through compiling (a 3B-shaped layer: 0.4 GB)."""
    read = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    tensors = [*graph.named_parameters(remove_duplicate=False), *graph.named_buffers(remove_duplicate=False)]
    for name, _ in tensors:
        if name not in read:
            owner, _, attribute = name.rpartition(".")
            delattr(graph.get_submodule(owner), attribute)
    graph.delete_all_unused_submodules()
    return graph


def share_equal_constants(graphs: dict) -> None:
    """Constants of equal value in the methods' converted graphs (a shard's quantized weights,
    converted once per method) made one tensor, held once while the graphs are compiled."""
    seen: dict[tuple, torch.Tensor] = {}
    for graph in graphs.values():
        for node in graph.graph.nodes:
            if node.op != "get_attr" or "." in node.target:
                continue
            tensor = getattr(graph, node.target, None)
            if not isinstance(tensor, torch.Tensor) or tensor.numel() < 1024:
                continue
            data = tensor.detach().contiguous()
            key = (data.dtype, tuple(data.shape), hashlib.sha256(data.view(torch.uint8).numpy()).digest())
            if key in seen:
                setattr(graph, node.target, seen[key])
            else:
                seen[key] = tensor


def skipped_op_set(options: dict) -> set:
    ops = set()
    for name in options.get("skip_ops") or []:
        ops.add(name if name.endswith((".default", ".Tensor", ".Scalar", ".int", ".dim")) else f"{name}.default")
    return ops


def lower_qnn_shard(work: ShardWork, stages: dict[str, float]) -> BackendLowering:
    """A QNN shard from its float module to its .pte: calibrated (quantized precisions) on the
    calls of work.calls, its input for each being work.stream (the float model's output of the
    shard before it; None for the embedding's shard), lowered, and measured on the held-out calls.
    The graphs being calibrated run the calls themselves (their outputs fill the shard's cache:
    observers leave values as they are); the float module runs the held-out calls, first, and its
    outputs are kept to measure the lowered shard. The float module is let go before the shard is
    compiled, where a QNN shard needs the most memory.

    Quantized native I/O: each layer's cache gets one range (input and new-entry output, every
    method), and the hidden state out of the shard the range of work.next_stream (the float
    model's output of this shard, as the next shard takes it), so that two adjacent QNN shards meet
    without a conversion and neither needs the other to be calibrated. While QNN compiles, the
    weights wait on disk (lean_preprocess): beside the .pte where the job shares the export's disk,
    else where temporary files go."""
    examples, names, options, calls, stream = (
        work.examples(),
        work.names(),
        work.placement.options,
        work.calls,
        work.stream,
    )
    started = time.perf_counter()
    module = load_shard(work)
    stages["read"] = time.perf_counter() - started
    methods = work.methods
    positions = work.max_seq_len + max(methods.values())
    held_out, expected = held_out_pass(module, calls, stream, methods, work.max_seq_len)
    started = time.perf_counter()
    job = QnnShardLowering(module, examples, names, options, positions)
    if job.quantized:
        shard = ShardReplay(module, methods, work.max_seq_len)
        for i, call in enumerate(calls):
            if not call.held_out:
                inputs = shard.inputs(call, None if stream is None else stream[i])
                shard.run(call, inputs, lambda *xs, method=call.method: job.observe(method, xs))
        job.share_io_ranges(stream_ranges(calls, work.next_stream) if work.next_stream is not None else {})
        stages["calibrate"] = time.perf_counter() - started
        del shard
    del module
    started = time.perf_counter()

    def timed_measure(buffer: bytes) -> tuple:
        measuring = time.perf_counter()
        return measure(buffer, held_out, expected, names, job.io_encodings), time.perf_counter() - measuring

    weights_to = str(Path(work.output).parent) if work.output else tempfile.gettempdir()
    lowered, own, context, measured = job.lower(timed_measure, weights_to)
    sqnr, worst, stages["measure"] = {}, {}, 0.0
    for (program_sqnr, program_worst), seconds in measured:
        sqnr.update(program_sqnr)
        worst.update(program_worst)
        stages["measure"] += seconds
    stages["lower"] = time.perf_counter() - started - stages["measure"]
    facts = {"spill_fill_bytes": own, "htp_context_bytes": context, "sqnr_db": sqnr, "sqnr_worst_token_db": worst}
    return BackendLowering(lowered, job.io_encodings, facts)


def stream_ranges(calls: list, stream: list) -> dict[str, tuple[float, float]]:
    """method -> (min, max) of a float stream over the calibration calls (not the held-out ones),
    a decode step's value standing for its method's."""
    ranges: dict[str, tuple[float, float]] = {}
    for call, x in zip(calls, stream):
        if not call.held_out:
            low, high = ranges.get(call.method, (float("inf"), float("-inf")))
            ranges[call.method] = (min(low, float(x.min())), max(high, float(x.max())))
    return ranges
