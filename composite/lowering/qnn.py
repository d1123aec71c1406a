"""Qualcomm QNN HTP: fp16 or quantized (16a4w, 16a8w, 8a8w, 16a16w) shards, optionally leaving
chosen ops to XNNPACK inside the same .pte.

The shard is first rewritten into its HTP-friendly form (htp_graph.py). Quantized precisions are
calibrated with the shard's real inputs (calibration.py captures them from the float model) and
converted with ExecuTorch's QnnQuantizer through torchao's pt2e flow. Every QNN program is compiled
with multi-context enabled so that one spill-fill size, computed over all QNN shards of the export
(`share_spill_fill`), can be written into each of them.
"""

from __future__ import annotations

import fnmatch

import torch

from composite.errors import UserError

QUANT_DTYPES = {"16a4w": "use_16a4w", "16a8w": "use_16a8w", "8a8w": "use_8a8w", "16a16w": "use_16a16w"}


def require_support() -> None:
    """Fail early, with one line, when this process cannot lower or run QNN shards."""
    from composite import qnn_host

    qnn_host.activate()


def compile_spec(options: dict):
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    backend = generate_htp_compiler_spec(use_fp16=options["precision"] == "fp16", use_multi_contexts=True)
    return generate_qnn_executorch_compiler_spec(soc_model=getattr(QcomChipset, options["soc"]), backend_options=backend)


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

    def qconfig(precision: str):
        return ModuleQConfig(getattr(QuantDtype, QUANT_DTYPES[precision]), is_conv_per_channel=True, is_linear_per_channel=True)

    quantizer = QnnQuantizer()
    quantizer.default_quant_config = qconfig(options["precision"])
    overrides = options.get("overrides") or {}
    quantizer.set_submodule_qconfig_list([(_module_path_predicate(p), qconfig(v)) for p, v in overrides.items()])
    return quantizer


def quantize(module, example_inputs: dict, options: dict, samples: dict) -> dict:
    """method -> converted GraphModule, calibrated with `samples[method]` (lists of input tuples)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    converted = {}
    for method, inputs in example_inputs.items():
        if not samples.get(method):
            raise UserError(f"no calibration samples for the {method} method of a {options['precision']} QNN shard")
        with torch.no_grad():
            graph = torch.export.export(module, inputs, strict=False).module()
            prepared = prepare_pt2e(graph, quantizer_for(options))
            for sample in samples[method]:
                prepared(*sample)
            converted[method] = convert_pt2e(prepared)
    return converted


def skipped_op_set(options: dict) -> set:
    ops = set()
    for name in options.get("skip_ops") or []:
        ops.add(name if name.endswith((".default", ".Tensor", ".Scalar", ".int", ".dim")) else f"{name}.default")
    return ops


def lower(module, example_inputs: dict, options: dict, samples: dict | None = None):
    """-> (EdgeProgramManager, notes). XNNPACK takes what QNN is told to skip."""
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.backends.qualcomm.utils.qnn_sdk_setup import setup_qnn_sdk
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from composite.lowering.htp_graph import htp_form

    require_support()
    setup_qnn_sdk()
    htp = htp_form(module).eval()
    if options["precision"] == "fp16":
        graphs = {method: htp for method in example_inputs}
    else:
        graphs = quantize(htp, example_inputs, options, samples or {})
    spec = compile_spec(options)
    skip_ops = skipped_op_set(options)
    skip_ids = set(options.get("skip_node_ids") or [])
    programs, passes, partitioners = {}, {}, {}
    for method, graph in graphs.items():
        with torch.no_grad():
            exported = torch.export.export(graph, example_inputs[method], strict=False)
        pass_manager = get_qnn_pass_manager_cls()()
        programs[method] = pass_manager.transform_for_export_pipeline(exported)
        passes[method] = pass_manager.get_to_edge_transform_passes(
            exported, compiler_specs=spec, skip_node_id_set=skip_ids, skip_node_op_set=skip_ops
        )
        partitioners[method] = [QnnPartitioner(spec, skip_node_id_set=skip_ids, skip_node_op_set=skip_ops)]
        if skip_ops or skip_ids:
            partitioners[method].append(XnnpackPartitioner())
    with QnnManagerContext({method: spec for method in graphs}):
        edge = to_edge_transform_and_lower(
            programs, transform_passes=passes, partitioner=partitioners, compile_config=qnn_edge_config()
        )
    notes = []
    if skip_ops or skip_ids:
        notes.append(f"left to XNNPACK: ops {sorted(skip_ops) or '-'}, node ids {sorted(skip_ids) or '-'}")
    return edge, notes


def qnn_backend_modules(edge) -> list:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    modules = []
    for method in edge.methods:
        for submodule in edge.exported_program(method).graph_module.modules():
            if isinstance(submodule, LoweredBackendModule) and submodule.backend_id == "QnnBackend":
                modules.append(submodule)
    return modules


def share_spill_fill(edges: list) -> int:
    """One spill-fill buffer size for every QNN context of every shard (the maximum any of them
    needs), written into each context's compile spec. On device the HTP backend keeps one
    process-wide buffer of that size for all of them."""
    from executorch.backends.qualcomm.utils.utils import update_spill_fill_size

    modules = [m for edge in edges for m in qnn_backend_modules(edge)]
    return int(update_spill_fill_size(modules)) if modules else 0
