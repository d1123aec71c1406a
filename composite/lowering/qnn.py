"""Qualcomm QNN HTP: fp16 or quantized (16a4w, 16a8w, 8a8w, 16a16w) shards, optionally leaving
chosen ops to XNNPACK inside the same .pte.

The shard is first rewritten into its HTP-friendly form (htp_graph.py). Quantized precisions are
calibrated with the shard's real inputs (calibration.py streams them from the float model into the
observers) and converted with ExecuTorch's QnnQuantizer through torchao's pt2e flow. Every QNN program is compiled
with multi-context enabled so that one spill-fill size, computed over all QNN shards of the export
(`share_spill_fill`), can be written into each of them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import importlib
import json
import time

import torch
from executorch.runtime import Runtime

from composite import qnn_host
from composite.errors import UserError
from composite.lowering import native_io
from composite.lowering.calibration import calibrate, sqnr_db
from composite.lowering.htp_graph import QUANTIZED_MASK_FLOOR, htp_form
from composite.lowering.program import finish
from composite.runtime.encoding import convert

QUANT_DTYPES = {"16a4w": "use_16a4w", "16a8w": "use_16a8w", "8a8w": "use_8a8w", "16a16w": "use_16a16w"}


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


def _module_path_predicate(pattern: str):
    """True for nodes inside the module named by `pattern` (fnmatch, e.g. "layers.*.attention.wo")."""

    def predicate(node: torch.fx.Node) -> bool:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            if any(fnmatch.fnmatchcase(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
                return True
        return False

    return predicate


def quantizer_for(options: dict):
    from executorch.backends.qualcomm.quantizer.quantizer import ModuleQConfig, QnnQuantizer, QuantDtype
    from torchao.quantization.pt2e import MinMaxObserver

    # Plain min/max over all calibration inputs: QNN's default moving-average observer tracks the
    # mean per-call range, which clips the largest activations of a token it has not seen.
    def qconfig(precision: str):
        return ModuleQConfig(
            getattr(QuantDtype, QUANT_DTYPES[precision]),
            is_conv_per_channel=True,
            is_linear_per_channel=True,
            act_observer=MinMaxObserver,
        )

    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    quantizer = QnnQuantizer(soc_model=getattr(QcomChipset, options["soc"]))
    quantizer.default_quant_config = qconfig(options["precision"])
    overrides = options.get("overrides") or {}
    quantizer.set_submodule_qconfig_list([(_module_path_predicate(p), qconfig(v)) for p, v in overrides.items()])
    return quantizer


@contextlib.contextmanager
def linear_time_observers():
    """prepare_pt2e with two quadratic costs of torch 2.13 / torchao removed, same graph out.

    - Each observer's attribute name is found by trying activation_post_process_0, _1, ... until
      one is free: quadratic in the observers (thousands in a shard of a few layers). Names are
      handed out in order and none is removed while preparing, so the search can go on from the
      last name given.
    - Each observer's constructor arguments are deep-copied and thrown away; ExecuTorch's QNN
      ConcatObserver takes the whole fx graph as an argument, so every concatenation copied the
      graph twice. The arguments (dtypes, ranges, the constructor) are only read: a shallow copy.
    On a 7-layer SmolLM2 shard this is most of the minutes its prepare took."""
    # the modules (their packages export functions of the same names)
    fx_prepare = importlib.import_module("torch.ao.quantization.fx.prepare")
    pt2e_prepare = importlib.import_module("torchao.quantization.pt2e.prepare")

    next_free: dict[tuple[int, str], int] = {}

    def attr_name_with_prefix(prefix: str):
        prefix = prefix.replace(".", "_")

        def new_name(module):
            index = next_free.get((id(module), prefix), 0)
            while hasattr(module, f"{prefix}{index}"):
                index += 1
            next_free[(id(module), prefix)] = index + 1
            return f"{prefix}{index}"

        return new_name

    def observer_kwargs(quant_spec):
        return {field.name: getattr(quant_spec, field.name) for field in dataclasses.fields(quant_spec)}

    saved = fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs
    fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs = attr_name_with_prefix, observer_kwargs
    try:
        yield
    finally:
        fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs = saved


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

    def observe(self, method: str, inputs) -> None:
        """One calibration input (quantized precisions only)."""
        with torch.no_grad():
            self.graphs[method](*inputs)
        self.calibrated[method] += 1

    def lower(self):
        """-> (EdgeProgramManager, notes, the host twin's .pte bytes or None). XNNPACK takes what QNN
        is told to skip. A weight-shared shard cannot run on the x86 simulator, so its twin without
        weight sharing (same graphs, same quantization) is compiled too, to measure it here."""
        graphs = self.graphs
        if self.quantized:
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            missing = [method for method, count in self.calibrated.items() if count == 0]
            if missing:
                raise UserError(
                    f"no calibration inputs reached the {', '.join(missing)} method of a "
                    f"{self.options['precision']} QNN shard"
                )
            graphs = {method: convert_pt2e(graph) for method, graph in graphs.items()}
            if self.native_io:
                self.io_encodings = {m: native_io.read_params(g, *self.names[m]) for m, g in graphs.items()}
        edge = self._to_edge(graphs, compile_spec(self.options))
        twin = None
        if self.options["weight_sharing"]:
            unshared = self._to_edge(graphs, compile_spec({**self.options, "weight_sharing": False}))
            twin = finish(unshared, [], self.planning()).buffer
        notes = []
        if self.quantized:
            notes.append("calibrated with " + ", ".join(f"{n} {m} inputs" for m, n in self.calibrated.items()))
        if self.skip_ops or self.skip_ids:
            notes.append(
                f"left to XNNPACK: ops {sorted(self.skip_ops) or '-'}, node ids {sorted(self.skip_ids) or '-'}"
            )
        if twin is not None:
            notes.append("weights shared by its methods; SQNR measured on its unshared twin (same graphs)")
        return edge, notes, twin

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
        return {method: native_io.planning_pass(*self._positions(method)) for method in self.graphs}

    def _to_edge(self, graphs: dict, spec):
        from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
        from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
        from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
        from executorch.backends.qualcomm.utils.utils import qnn_edge_config
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        programs, passes, partitioners = {}, {}, {}
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
            partitioners[method] = [
                QnnPartitioner(spec, skip_node_id_set=self.skip_ids, skip_node_op_set=self.skip_ops)
            ]
            if self.skip_ops or self.skip_ids:
                partitioners[method].append(XnnpackPartitioner())
        # One context holds every method's graph (ExecuTorch's multi-method preprocess); with weight
        # sharing in the spec, they hold one copy of the weights between them.
        with QnnManagerContext({method: spec for method in graphs}):
            return to_edge_transform_and_lower(
                programs, transform_passes=passes, partitioner=partitioners, compile_config=qnn_edge_config()
            )


def skipped_op_set(options: dict) -> set:
    ops = set()
    for name in options.get("skip_ops") or []:
        ops.add(name if name.endswith((".default", ".Tensor", ".Scalar", ".int", ".dim")) else f"{name}.default")
    return ops


def qnn_backend_modules(edge) -> list:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    modules = []
    for method in edge.methods:
        for submodule in edge.exported_program(method).graph_module.modules():
            if isinstance(submodule, LoweredBackendModule) and submodule.backend_id == "QnnBackend":
                modules.append(submodule)
    return modules


def share_spill_fill(edges: list, floor: int = 0) -> tuple[int, list[int]]:
    """One spill-fill buffer size for every QNN context of every shard: the maximum any of them
    needs (at least `floor`: the needs of QNN shards taken from the cache), written into each
    context's compile spec. On device the HTP backend keeps one process-wide buffer of that size
    for all of them. Returns (shared size, each shard's own need)."""
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
        flatbuffer_to_option,
        option_to_flatbuffer,
    )
    from executorch.backends.qualcomm.utils.constants import QCOM_QNN_COMPILE_SPEC
    from executorch.backends.qualcomm.utils.utils import update_spill_fill_size
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    own = [int(update_spill_fill_size(modules)) if (modules := qnn_backend_modules(edge)) else 0 for edge in edges]
    every = [m for edge in edges for m in qnn_backend_modules(edge)]
    shared = int(update_spill_fill_size(every)) if every else 0
    if floor > shared:
        for module in every:
            options = flatbuffer_to_option(module.compile_specs[0].value)
            options.backend_options.htp_options.max_sf_buf_size = floor
            module._compile_specs[0] = CompileSpec(QCOM_QNN_COMPILE_SPEC, option_to_flatbuffer(options))
        shared = floor
    return shared, own


class QnnShards:
    """Every QNN shard of one export, handled together where they must be: built, then calibrated
    in shared passes of the float chain (shards with the same calibration options share one), then
    lowered one by one, then given one spill-fill size, then measured (SQNR against the float shard
    on an input calibration never saw)."""

    def __init__(
        self,
        model,
        modules: list,
        jobs: dict[int, QnnShardLowering],
        methods: dict[str, int],
        max_seq_len: int,
        tokenizer,
        bos_id: int | None = None,
    ):
        self.modules, self.jobs = modules, jobs
        self.lowered: dict[int, tuple] = {}  # shard index -> (edge program, notes, twin), until finish()
        started = time.perf_counter()
        self.held_out = self._calibrate(model, methods, max_seq_len, tokenizer, bos_id)
        self._share_io_ranges()
        quantized = any(job.quantized for job in jobs.values())
        self.calibration_seconds = round(time.perf_counter() - started, 2) if quantized else None

    def _calibrate(self, model, methods: dict[str, int], max_seq_len: int, tokenizer, bos_id) -> dict[int, dict]:
        groups: dict[str, dict[int, QnnShardLowering]] = {}
        for index, job in self.jobs.items():
            groups.setdefault(json.dumps(job.options.get("calibration") or {}, sort_keys=True), {})[index] = job
        held_out = {}
        for key, group in groups.items():
            consumers = {
                index: job.observe if job.quantized else (lambda method, inputs: None) for index, job in group.items()
            }
            options = json.loads(key)
            if not any(job.quantized for job in group.values()):
                options["samples"] = 0  # fp16 shards need only the held-out input, to measure SQNR
            held_out.update(calibrate(model, self.modules, consumers, methods, max_seq_len, options, tokenizer, bos_id))
        return held_out

    def _share_io_ranges(self) -> None:
        """One range per layer cache (its input and new-entry output, in every method) and per
        hidden state passed between two adjacent quantized-I/O QNN shards (in each method)."""
        groups: dict[tuple, list] = {}
        for index, job in self.jobs.items():
            for method in job.graphs:
                for (side, name), observer in job.io_observers(method).items():
                    if name == "hidden":
                        key = ("hidden", index if side == "out" else index - 1, method)
                    else:
                        key = (name.split("_")[0], name.split(".")[1])  # ("k" | "v", layer)
                    groups.setdefault(key, []).append(observer)
        native_io.share_ranges(list(groups.values()))

    def lower(self, index: int) -> None:
        job = self.jobs.pop(index)  # the prepared graphs go once lowered
        edge, notes, twin = job.lower()
        self.lowered[index] = (edge, notes, twin, job.io_encodings, job.planning())

    def finish(self, io_names: dict[int, dict[str, tuple]], spill_fill_floor: int = 0) -> tuple[dict[int, tuple], dict]:
        """io_names: shard index -> method -> (its inputs' names, its outputs' names). -> ({shard index:
        (LoweredShard, own spill-fill bytes, (SQNR per method and output, worst-token SQNR per
        method), native I/O encodings per method)}, the manifest's qnn summary)."""
        indices = sorted(self.lowered)
        shared, own = share_spill_fill([self.lowered[i][0] for i in indices], spill_fill_floor)
        host = qnn_host.prepare()
        results = {}
        for index, own_bytes in zip(indices, own):
            edge, notes, twin, io_encodings, planning = self.lowered.pop(index)
            shard = finish(edge, notes, planning)
            measured = self.measure(twin or shard.buffer, index, io_names[index], io_encodings)
            results[index] = (shard, own_bytes, measured, io_encodings)
        summary = {
            "build_id": host.build_id,
            "libraries": host.source,
            "spill_fill_bytes": shared,
            "calibration_seconds": self.calibration_seconds,
        }
        return results, summary

    def measure(
        self, buffer: bytes, index: int, names: dict[str, tuple], io_encodings: dict
    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """(method -> output name -> SQNR in dB, method -> SQNR of the main output's worst token)
        of the lowered shard (its .pte bytes) against the float shard, native I/O converted as the
        runners convert it. A trained model's residual stream holds single values of ~25,000 on its
        first token, which dominate a whole tensor's SQNR: the worst token shows the rest."""
        program = Runtime.get().load_program(buffer)
        result, worst = {}, {}
        for method in names:  # decode, then prefill, as the manifest lists methods
            inputs = self.held_out[index][method]
            encodings = io_encodings.get(method) or {}
            input_names, output_names = names[method]
            fed = [convert(t, None, encodings.get(("in", name))) for name, t in zip(input_names, inputs)]
            actual = program.load_method(method).execute(fed)
            actual = [convert(t, encodings.get(("out", name)), None) for name, t in zip(output_names, actual)]
            with torch.no_grad():
                expected = self.modules[index](*inputs)
            result[method] = {name: round(sqnr_db(e, a), 2) for name, e, a in zip(output_names, expected, actual)}
            main_expected, main_actual = expected[0][0], actual[0][0]  # [T, dim or vocab]
            worst[method] = round(min(sqnr_db(e, a) for e, a in zip(main_expected, main_actual)), 2)
        return result, worst
