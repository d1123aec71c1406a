"""The QNN quantizer of a shard: its precision, the per-module overrides, block sizes, observers.

ExecuTorch's QnnQuantizer annotates the graph (the HTP form, htp_graph.py) for torchao's pt2e
flow: `precision` for every op, `overrides` (module path pattern -> precision) for the modules
they name, e.g. {"output": "16a8w", "layers.*.feed_forward.w2": "16a8w"}. The online rotation of
`rotate: hadamard-ffn` (model/llama.py's KroneckerRotation: two matmuls by constant matrices) keeps
16-bit weights in shards of 16-bit activations, whatever the precision: its weights are a rotation,
not the model's, and the HTP computes 4-bit weights of such a matmul (a FullyConnected, not a 1x1
convolution) otherwise than the quantized graph does, though the Hadamard factors sit exactly on
the 4-bit grid (docs/quality.md). Where a precision is 16a4w_block, every 1x1 convolution (a linear in the HTP form) whose input channels divide into
blocks of `block_size` gets 4-bit weights in such blocks (LPBQ, lpbq.py); one whose input channels
do not keeps 16a4w's per-channel 4-bit weights.
"""

from __future__ import annotations

import fnmatch

import torch

QUANT_DTYPES = {
    "16a4w": "use_16a4w",
    "16a4w_block": "use_16a4w_block",
    "16a8w": "use_16a8w",
    "8a8w": "use_8a8w",
    "16a16w": "use_16a16w",
}


ROTATION_MODULES = "*.hidden_rotation"  # model/llama.py: FeedForward.hidden_rotation


def rotation_precision(precision: str) -> str:
    """The precision of the online rotation's matmuls in a shard of `precision` (module docstring)."""
    return "16a16w" if precision.startswith("16a") else precision


def module_path_predicate(pattern: str):
    """True for nodes inside the module named by `pattern` (fnmatch, e.g. "layers.*.attention.wo")."""

    def predicate(node: torch.fx.Node) -> bool:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            if any(fnmatch.fnmatchcase(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
                return True
        return False

    return predicate


def quantizer_for(options: dict):
    """The QnnQuantizer a QNN placement's options (config.py) ask for."""
    from executorch.backends.qualcomm.quantizer.quantizer import ModuleQConfig, QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e import MinMaxObserver

    # Plain min/max over all calibration inputs: QNN's default moving-average observer tracks the
    # mean per-call range, which clips the largest activations of a token it has not seen.
    def qconfig(precision: str):
        config = ModuleQConfig(
            getattr(QuantDtype, QUANT_DTYPES[precision]),
            is_conv_per_channel=True,
            is_linear_per_channel=True,
            act_observer=MinMaxObserver,
        )
        if precision == "16a4w_block":
            on_lpbq_grid(config)
        return config

    quantizer = QnnQuantizer(soc_model=getattr(QcomChipset, options["soc"]))
    quantizer.default_quant_config = qconfig(options["precision"])
    overrides = options.get("overrides") or {}
    rules = [(module_path_predicate(p), qconfig(v)) for p, v in overrides.items()]
    rotation = rotation_precision(options["precision"])
    if rotation != options["precision"]:  # the first rule a node matches applies
        rules.insert(0, (module_path_predicate(ROTATION_MODULES), qconfig(rotation)))
    quantizer.set_submodule_qconfig_list(rules)
    if "16a4w_block" in (options["precision"], *overrides.values()):
        annotate = quantizer.annotate

        def annotate_in_blocks(model: torch.fx.GraphModule):
            quantizer.set_block_size_map(block_size_map(model, quantizer, options.get("block_size", 32)))
            return annotate(model)

        quantizer.annotate = annotate_in_blocks
    return quantizer


def on_lpbq_grid(config) -> None:
    """A 16a4w_block ModuleQConfig whose block weights get scales on the HTP's grid (lpbq.py)."""
    import dataclasses

    from composite.lowering.qnn.lpbq import LpbqObserver

    for i, block_config in enumerate(config.per_block_quant_config_list):
        spec = block_config.weight
        observer = LpbqObserver.with_args(**spec.observer_or_fake_quant_ctr.p.keywords)
        config.per_block_quant_config_list[i] = dataclasses.replace(
            block_config, weight=dataclasses.replace(spec, observer_or_fake_quant_ctr=observer)
        )


def block_size_map(model: torch.fx.GraphModule, quantizer, block: int) -> dict[str, tuple]:
    """node name -> block size, for each 1x1 convolution of `model` whose module's precision is
    block-wise (its ModuleQConfig has per-block configs) and whose input channels divide into
    `block`, as QnnQuantizer.set_block_size_map takes it: read from the graph it annotates."""
    sizes = {}
    for node in model.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.conv2d.default:
            continue
        weight = node.args[1]
        shape = weight.meta["val"].shape if "val" in weight.meta else model.get_parameter(weight.target).shape
        per_block = getattr(quantizer._get_submodule_qconfig(node), "per_block_quant_config_list", None)
        if per_block and tuple(shape[2:]) == (1, 1) and shape[1] % block == 0:
            sizes[node.name] = (1, block, 1, 1)
    return sizes
