"""Qualcomm QNN HTP: fp16 or quantized (16a4w, 16a8w, 8a8w, 16a16w) shards, optionally leaving
chosen ops to XNNPACK inside the same .pte.

The shard is first rewritten into its HTP-friendly form (htp_graph.py). Quantized precisions are
calibrated with the shard's real inputs (the float model's, as calibration.py replays them) and
converted with ExecuTorch's QnnQuantizer through torchao's pt2e flow. Every QNN program is compiled
with multi-context enabled, each with the spill-fill size it needs itself; the export then writes
the largest of them into every QNN shard (`with_spill_fill`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import hashlib
import importlib
import os
import struct
import time
from collections.abc import Callable

import torch

from composite import qnn_host
from composite.errors import UserError
from composite.executor.fork import ForkedCall
from composite.lowering import native_io
from composite.lowering.calibration import ShardReplay, sqnr_db
from composite.lowering.htp_graph import QUANTIZED_MASK_FLOOR, htp_form
from composite.lowering.program import LoweredShard, executorch_config, finish
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


@contextlib.contextmanager
def lean_preprocess(weights_to: str | None = None):
    """QNN's preprocess without copies of the weights it no longer reads.

    - ExecuTorch deep-copies every partition's program before a backend's preprocess
      (BackendDetails.copy_exported_program_for_preprocess, in case the backend changes it), and
      QNN's preprocess holds the copies of all methods while it compiles them into one context: a
      copy of the shard's quantized weights per method (a 3B-shaped layer: 0.1 GB each). QNN's
      preprocess passes rewrite the graph, not the tensors' data: the copy takes the graph and
      shares the tensors.
    - By the time QNN compiles, its tensor wrappers hold their own copies of the weights, yet the
      programs' tensors stay alive through the compile, its peak (0.7 GB in a 7-layer 3B-shaped
      shard). With a folder `weights_to` (on a disk: on tmpfs it would be memory still), their
      data is moved just before it to a file there and mapped back copy-on-write: the same values
      for whatever reads them after, in memory only if it does.
    Same context binaries."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as qnn_manager
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend

    if "copy_exported_program_for_preprocess" in vars(QnnBackend):  # a QNN with a copy of its own: left to it
        yield
        return
    wrapped: list[torch.Tensor] = []  # the tensors of the programs QNN has been given

    def copy_sharing_constants(cls, program, compile_specs):
        tensors = [
            t for t in [*program.state_dict.values(), *program.constants.values()] if isinstance(t, torch.Tensor)
        ]
        wrapped.extend(tensors)
        return copy.deepcopy(program, memo={id(t): t for t in tensors})

    compile_ = qnn_manager.QnnManager.Compile

    def compile_with_weights_on_disk(manager, *args):
        if weights_to is not None:
            mapped_from_disk(wrapped, weights_to)
        wrapped.clear()
        return compile_(manager, *args)

    QnnBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_constants)
    qnn_manager.QnnManager.Compile = compile_with_weights_on_disk
    try:
        yield
    finally:
        del QnnBackend.copy_exported_program_for_preprocess
        qnn_manager.QnnManager.Compile = compile_


def mapped_from_disk(tensors: list[torch.Tensor], folder: str, smallest: int = 1 << 16) -> None:
    """Each tensor's data (of `smallest` bytes or more) written to one file in `folder` and the
    tensor made to read it from there (a private map of the file, unlinked at once): every holder
    of the tensor sees the same values, and its old storage is freed unless another tensor shares
    it. Pages are read back from the file only where something reads them."""
    import tempfile

    tensors = [t for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.untyped_storage().nbytes() >= smallest:
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    if not storages:
        return
    offsets, size = {}, 0
    for key, storage in storages.items():
        offsets[key] = size
        size += -(-storage.nbytes() // 4096) * 4096  # page-aligned: every dtype's element offset whole
    handle, path = tempfile.mkstemp(prefix="composite-qnn-weights-", dir=folder)
    try:
        with open(handle, "wb") as file:
            for key, storage in storages.items():
                file.seek(offsets[key])
                file.write(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
            file.truncate(size)
        mapped = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).untyped_storage()
    finally:
        os.unlink(path)
    with torch.no_grad():
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key in offsets:
                first = offsets[key] // t.element_size() + t.storage_offset()
                t.set_(mapped, first, t.size(), t.stride())


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

    def observe(self, method: str, inputs):
        """One calibration input (quantized precisions only); -> the graph's outputs (the float
        shard's, as the observers leave values as they are)."""
        with torch.no_grad():
            outputs = self.graphs[method](*inputs)
        self.calibrated[method] += 1
        return outputs

    def lower(
        self, measure: Callable[[bytes], tuple], weights_to: str | None = None
    ) -> tuple[LoweredShard, int, int, list]:
        """-> (the lowered shard, whose contexts carry the spill-fill size they need, that size,
        the bytes of its context binaries, [measure(.pte bytes)] of what runs on this host: one
        item a program, each measuring the methods it has). XNNPACK takes what QNN is told to
        skip. A weight-shared shard cannot run on the x86 simulator: its twin without weight
        sharing (same graphs, same quantization) is compiled and measured instead, one method at
        a time, each in a forked process before the shard's own compile, so that neither
        compile's leftovers (memory the process keeps after it, ~0.2 GB a 3B-shaped layer) lie
        under the other's peak, and a twin method's compile (half the shard's) stays below the
        shard's. The prepared graphs, and the float weights they hold, are let go as each is
        converted: compiling is where a QNN shard needs the most memory. weights_to: a folder on
        disk where the weights wait while the shard compiles (lean_preprocess; not the twin's:
        a fork's weights are its parent's pages)."""
        graphs, self.graphs = self.graphs, None
        if self.quantized:
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            missing = [method for method, count in self.calibrated.items() if count == 0]
            if missing:
                raise UserError(
                    f"no calibration inputs reached the {', '.join(missing)} method of a "
                    f"{self.options['precision']} QNN shard"
                )
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
        # Decomposing and QNN's edge passes are most of a shard's lowering time (sharing them took
        # a 1B-shaped layer's job from 494 s to 303 s): they do not depend on weight sharing.
        edge = self._edge(graphs)
        del graphs
        measured = []
        if self.options["weight_sharing"]:
            notes.append("weights shared by its methods; SQNR measured on its unshared twin (same graphs)")
            measured = [ForkedCall(self._measured_twin, (edge, method, measure)).result() for method in self.names]
        partitioned = self._partitioned(edge, compile_spec(self.options), weights_to=weights_to)
        del edge
        content_signatures(partitioned)
        own = own_spill_fill(partitioned)
        # one context per payload; the methods of a context share it (content_signatures made the
        # signature a hash of the rest)
        context_bytes = sum(
            {m.processed_bytes[4:12]: len(m.processed_bytes) for m in qnn_backend_modules(partitioned)}.values()
        )
        shard = finish(partitioned, notes, self.planning())
        del partitioned
        return shard, own, context_bytes, measured or [measure(shard.buffer)]

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


def forget_cached_modules() -> None:
    """torch's and torchao's device lookups of prepare and convert are functools.cache'd on the
    module: every graph they saw, and its float weights, stays alive until the process ends."""
    from torch.ao.quantization.fx.utils import assert_and_get_unique_device
    from torchao.utils import _assert_and_get_unique_device

    assert_and_get_unique_device.cache_clear()
    _assert_and_get_unique_device.cache_clear()


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


def qnn_backend_modules(edge) -> list:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    modules = []
    for method in edge.methods:
        for submodule in edge.exported_program(method).graph_module.modules():
            if isinstance(submodule, LoweredBackendModule) and submodule.backend_id == "QnnBackend":
                modules.append(submodule)
    return modules


CONTEXT_MAGIC = 0xABCD  # low half of 0x5678ABCD, ExecuTorch's QnnContextCustomProtocol magic number


def content_signatures(edge) -> None:
    """Each QNN context's signature made from its content. ExecuTorch writes a context's payload as
    magic (4 bytes), signature (int64), size (8 bytes), context binary; the signature is the time
    it was compiled, and the runtime uses it to find the context the methods of a program share
    (decode and prefill in one context). A hash of the rest of the payload identifies the context
    as well, and makes a shard's bytes the same wherever and whenever it is lowered (a local
    export, a cluster's, the cache's)."""
    signed: dict[bytes, bytes] = {}  # the methods of a context get one copy of it, not one each
    for module in qnn_backend_modules(edge):
        payload = module.processed_bytes
        magic, _ = struct.unpack_from("<Iq", payload)
        if magic & 0xFFFF != CONTEXT_MAGIC:
            raise RuntimeError(
                "a QNN delegate payload without ExecuTorch's context header: unknown ExecuTorch version?"
            )
        hasher = hashlib.sha256(payload[:4])
        hasher.update(memoryview(payload)[12:])
        digest = hasher.digest()
        if digest not in signed:
            signature = int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)
            signed[digest] = payload[:4] + struct.pack("<q", signature) + payload[12:]
        module._processed_bytes = signed[digest]


def own_spill_fill(edge) -> int:
    """The spill-fill bytes the shard's own contexts need, written into their compile specs (the
    export later raises it to the size shared by all QNN shards: with_spill_fill)."""
    from executorch.backends.qualcomm.utils.utils import update_spill_fill_size

    modules = qnn_backend_modules(edge)
    return int(update_spill_fill_size(modules)) if modules else 0


def with_spill_fill(buffer: bytes, size: int) -> bytes:
    """A lowered QNN shard's .pte with `size` as every context's spill-fill buffer. On device the
    HTP backend keeps one process-wide buffer of the largest size any context asks for, shared by
    all of them. Only the compile specs change (the context binaries do not depend on it), so the
    program is rewritten by ExecuTorch's own serializer, not lowered again; a shard that already
    has `size` is returned as it is. The rewritten file is a function of the shard's bytes and
    the size alone: a shard lowered here, on another machine or taken from the cache ends up the
    same."""
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
        flatbuffer_to_option,
        option_to_flatbuffer,
    )
    from executorch.backends.qualcomm.utils.constants import QCOM_QNN_COMPILE_SPEC
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    pte = deserialize_pte_binary(buffer)
    changed = False
    for plan in pte.program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != "QnnBackend":
                continue
            for spec in delegate.compile_specs:
                if spec.key != QCOM_QNN_COMPILE_SPEC:
                    continue
                options = flatbuffer_to_option(spec.value)
                if options.backend_options.htp_options.max_sf_buf_size != size:
                    options.backend_options.htp_options.max_sf_buf_size = size
                    spec.value = option_to_flatbuffer(options)
                    changed = True
    if not changed:
        return buffer
    config = executorch_config()
    return bytes(
        serialize_pte_binary(
            pte,
            extract_delegate_segments=config.extract_delegate_segments,
            segment_alignment=config.segment_alignment,
            constant_tensor_alignment=config.constant_tensor_alignment,
            delegate_alignment=config.delegate_alignment,
        )
    )


def settle_spill_fill(folder, entries: list[dict], job_stages: list[dict]) -> dict:
    """Every QNN shard of an export (the manifest `entries`, files in `folder`) gets the largest
    spill-fill size any of them needs (with_spill_fill), its entry's size and sha256 updated.
    Each entry's own "spill_fill_bytes" stays its own need. job_stages: the stages (name ->
    seconds) of the jobs this export ran. -> the manifest's qnn summary."""
    from composite import manifest as manifest_schema

    qnn = [e for e in entries if e["placement"]["backend"] == "qnn"]
    shared = max((e["spill_fill_bytes"] for e in qnn), default=0)
    for entry in qnn:
        if entry["spill_fill_bytes"] != shared:
            path = folder / entry["file"]
            path.write_bytes(with_spill_fill(path.read_bytes(), shared))
            entry["sha256"], entry["size"] = manifest_schema.sha256_file(path), path.stat().st_size
    calibration = [stages["calibrate"] for stages in job_stages if "calibrate" in stages]
    host = qnn_host.prepare()
    return {
        "build_id": host.build_id,
        "libraries": host.source,
        "spill_fill_bytes": shared,
        "calibration_seconds": round(sum(calibration), 2) if calibration else None,
    }


@dataclasses.dataclass
class QnnLowered:
    shard: LoweredShard  # its contexts' spill-fill size is the shard's own need
    spill_fill_bytes: int
    context_bytes: int  # its QNN context binaries' bytes: what the HTP holds of its weights and graphs
    sqnr_db: dict[str, dict[str, float]]  # method -> output name -> SQNR against the float shard
    sqnr_worst_token_db: dict[str, float]  # method -> SQNR of the main output's worst token
    io_encodings: dict  # method -> ("in" | "out", name) -> Encoding of its native I/O
    stages: dict[str, float]  # seconds: calibrate (quantized precisions), lower, measure


def lower_qnn_shard(
    load: Callable[[], torch.nn.Module],
    examples: dict,
    names: dict,
    options: dict,
    calls: list,
    stream: list | None,
    max_seq_len: int,
    next_stream: list | None = None,
    weights_to: str | None = None,
) -> QnnLowered:
    """One QNN shard, from its float module (load() makes it; this function holds the only
    reference, so that the float weights go before the shard is compiled) to its .pte: calibrated
    (quantized precisions) on the calls of a calibration run, its input for each being `stream`
    (the float model's output of the shard before it; None for the embedding's shard), lowered,
    and measured on the held-out calls. The graphs being calibrated run the calls themselves
    (their outputs fill the shard's cache: observers leave values as they are); the float module
    runs the held-out calls, first, and its outputs are kept to measure the lowered shard.

    Quantized native I/O: each layer's cache gets one range (input and new-entry output, every
    method), and the hidden state out of the shard the range of `next_stream` (the float model's
    output of this shard, as the next shard takes it), so that two adjacent QNN shards meet
    without a conversion and neither needs the other to be calibrated. weights_to: a folder on
    disk for the weights while QNN compiles (lean_preprocess; None: they stay in memory)."""
    started = time.perf_counter()
    module = load()
    stages = {"read": time.perf_counter() - started}
    methods = {method: inputs[0].shape[1] for method, inputs in examples.items()}
    positions = max_seq_len + max(methods.values())
    held_out, expected = held_out_pass(module, calls, stream, methods, max_seq_len)
    started = time.perf_counter()
    job = QnnShardLowering(module, examples, names, options, positions)
    if job.quantized:
        shard = ShardReplay(module, methods, max_seq_len)
        for i, call in enumerate(calls):
            if not call.held_out:
                inputs = shard.inputs(call, None if stream is None else stream[i])
                shard.run(call, inputs, lambda *xs, method=call.method: job.observe(method, xs))
        job.share_io_ranges(stream_ranges(calls, next_stream) if next_stream is not None else {})
        stages["calibrate"] = time.perf_counter() - started
        del shard
    del module
    started = time.perf_counter()

    def timed_measure(buffer: bytes) -> tuple:
        measuring = time.perf_counter()
        return measure(buffer, held_out, expected, names, job.io_encodings), time.perf_counter() - measuring

    lowered, own, context_bytes, measured = job.lower(timed_measure, weights_to)
    sqnr, worst, stages["measure"] = {}, {}, 0.0
    for (program_sqnr, program_worst), seconds in measured:
        sqnr.update(program_sqnr)
        worst.update(program_worst)
        stages["measure"] += seconds
    stages["lower"] = time.perf_counter() - started - stages["measure"]
    return QnnLowered(lowered, own, context_bytes, sqnr, worst, job.io_encodings, stages)


def held_out_pass(module, calls: list, stream: list | None, methods: dict, max_seq_len: int) -> tuple[dict, dict]:
    """(method -> the shard's inputs on its held-out call, method -> the float shard's outputs
    there). The held-out calls start a sequence of their own, so they need no other call."""
    shard = ShardReplay(module, methods, max_seq_len)
    inputs_by_method, outputs_by_method = {}, {}
    for i, call in enumerate(calls):
        if call.held_out:
            inputs = shard.inputs(call, None if stream is None else stream[i])
            outputs_by_method.setdefault(call.method, [t.clone() for t in shard.run(call, inputs)])
            inputs_by_method.setdefault(call.method, tuple(t.clone() for t in inputs))
    return inputs_by_method, outputs_by_method


def stream_ranges(calls: list, stream: list) -> dict[str, tuple[float, float]]:
    """method -> (min, max) of a float stream over the calibration calls (not the held-out ones),
    a decode step's value standing for its method's."""
    ranges: dict[str, tuple[float, float]] = {}
    for call, x in zip(calls, stream):
        if not call.held_out:
            low, high = ranges.get(call.method, (float("inf"), float("-inf")))
            ranges[call.method] = (min(low, float(x.min())), max(high, float(x.max())))
    return ranges


def measure(
    buffer: bytes, held_out: dict[str, tuple], expected: dict[str, list], names: dict[str, tuple], io_encodings: dict
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """(method -> output name -> SQNR in dB, method -> SQNR of the main output's worst token)
    of the lowered shard (its .pte bytes) against the float shard's outputs on the held-out
    inputs, native I/O converted as the runners convert it. A trained model's residual stream
    holds single values of ~25,000 on its first token, which dominate a whole tensor's SQNR: the
    worst token shows the rest."""
    # Loaded here, not on import: the CLIs that import this module answer bad flags in a second.
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)
    result, worst = {}, {}
    for method in [m for m in names if m in program.method_names]:  # as the manifest lists them
        inputs = held_out[method]
        encodings = io_encodings.get(method) or {}
        input_names, output_names = names[method]
        fed = [convert(t, None, encodings.get(("in", name))) for name, t in zip(input_names, inputs)]
        actual = program.load_method(method).execute(fed)
        actual = [convert(t, encodings.get(("out", name)), None) for name, t in zip(output_names, actual)]
        result[method] = {name: round(sqnr_db(e, a), 2) for name, e, a in zip(output_names, expected[method], actual)}
        main_expected, main_actual = expected[method][0][0], actual[0][0]  # [T, dim or vocab]
        worst[method] = round(min(sqnr_db(e, a) for e, a in zip(main_expected, main_actual)), 2)
    return result, worst
