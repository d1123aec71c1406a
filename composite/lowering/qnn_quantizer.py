"""The QNN quantizer of a shard: its precision, the per-module overrides, the observers.

ExecuTorch's QnnQuantizer annotates the graph (the HTP form, htp_graph.py) for torchao's pt2e
flow: `precision` for every op, `overrides` (module path pattern -> precision) for the modules
they name, e.g. {"output": "16a8w", "layers.*.feed_forward.w2": "16a8w"}.
"""

from __future__ import annotations

import fnmatch

import torch

QUANT_DTYPES = {"16a4w": "use_16a4w", "16a8w": "use_16a8w", "8a8w": "use_8a8w", "16a16w": "use_16a16w"}


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
        return ModuleQConfig(
            getattr(QuantDtype, QUANT_DTYPES[precision]),
            is_conv_per_channel=True,
            is_linear_per_channel=True,
            act_observer=MinMaxObserver,
        )

    quantizer = QnnQuantizer(soc_model=getattr(QcomChipset, options["soc"]))
    quantizer.default_quant_config = qconfig(options["precision"])
    overrides = options.get("overrides") or {}
    quantizer.set_submodule_qconfig_list([(module_path_predicate(p), qconfig(v)) for p, v in overrides.items()])
    return quantizer
