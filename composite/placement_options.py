"""A placement's options: the backends, each one's option names and values, their defaults, and
their checks (composite/config.py reads them from the YAML and the flags; docs/usage.md lists
them)."""

from __future__ import annotations

import difflib

from composite.errors import UserError
from composite.qnn_soc import htp_arch, precision_runs_on

BACKENDS = ("xnnpack", "portable", "qnn")
XNNPACK_QUANTIZE = ("none", "8da4w", "8da8w")
XNNPACK_DTYPES = ("fp32", "fp16")
XNNPACK_ATTENTION = ("graph", "kernel")
XNNPACK_HEAD_QUANTIZE = ("8da8w", "same", "none")
XNNPACK_WEIGHT_MAPPING = ("symmetric_no_clipping_err", "symmetric")
# The SoCs composite lowers QNN shards for; each one's HTP architecture, and which precisions it
# runs, are ExecuTorch's own facts (qnn_soc.py).
QNN_SOCS = ("SM8350", "SM8450", "SM8475", "SM8550", "SM8650", "SM8750", "SM8850")
QNN_PRECISIONS = ("fp16", "16a4w", "16a4w_block", "16a8w", "8a8w", "16a16w")
QNN_BLOCK_SIZES = (16, 32, 64)  # input channels per block of 16a4w_block (LPBQ) weights
QNN_ROUNDINGS = ("nearest", "gptq")  # of 4-bit weights onto their grid
BACKEND_OPTION_KEYS = {
    "xnnpack": ("quantize", "group_size", "dtype", "attention", "head_quantize", "weight_mapping"),
    "portable": (),
    "qnn": (
        "soc",
        "precision",
        "weight_sharing",
        "native_io",
        "overrides",
        "calibration",
        "skip_ops",
        "skip_node_ids",
        "max_context_mb",
        "block_size",
        "rounding",
    ),
}
DEFAULT_OPTIONS = {
    # attention: "kernel" = composite::attention in the decode method (composite/ops/attention.py)
    # dtype: fp16 = float16 weights, activations and native I/O (hidden state, KV cache)
    # head_quantize: a quantized shard's head (the output linear) keeps 8-bit weights by default,
    # chosen by the KL divergence measured with each (docs/quality.md, Results). weight_mapping:
    # torchao's symmetric mapping clips each group's largest weight to 7/7.5 of it at 4 bits;
    # symmetric_no_clipping_err picks the scale that clips nothing.
    "xnnpack": {
        "quantize": "none",
        "group_size": 32,
        "dtype": "fp32",
        "attention": "kernel",
        "head_quantize": "8da8w",
        "weight_mapping": "symmetric_no_clipping_err",
    },
    "portable": {},
    # weight_sharing: decode and prefill share one copy of the weights in the shard's QNN context.
    # The phone loads such a context; the x86 HTP simulator cannot, so exports to run on this host
    # turn it off (`--no-weight-sharing`), which leaves everything else identical.
    # native_io: the shard takes and gives its hidden state and KV cache in its own activation dtype
    # (float16 for fp16, uint16 for 16-bit activations, uint8 for 8-bit); false keeps float32 I/O.
    # block_size: 16a4w_block's input channels per block of 4-bit weights (ExecuTorch's Qualcomm
    # llama and QNN's LPBQ use 32).
    # rounding: how 16a4w_block's weights are rounded onto their grid: gptq (by the layer's
    # calibration inputs; composite/lowering/qnn/weight_rounding.py) or nearest.
    "qnn": {
        "soc": "SM8650",
        "precision": "fp16",
        "weight_sharing": True,
        "native_io": True,
        "block_size": 32,
        "rounding": "gptq",
    },
}


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_keys(mapping: dict, allowed, where: str) -> None:
    for key in mapping:
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise UserError(f"unknown key '{key}' in {where}{suggest(str(key), allowed)}; valid keys: {valid}")


def check_backend_options(backend: str, options: dict, where: str) -> None:
    if backend == "xnnpack":
        if options["quantize"] not in XNNPACK_QUANTIZE:
            raise UserError(
                f"{where}: xnnpack quantize must be one of {', '.join(XNNPACK_QUANTIZE)}, got {options['quantize']!r}"
            )
        if options["dtype"] not in XNNPACK_DTYPES:
            raise UserError(
                f"{where}: xnnpack dtype must be one of {', '.join(XNNPACK_DTYPES)}, got {options['dtype']!r}"
            )
        if options["dtype"] == "fp16" and options["quantize"] != "none":
            raise UserError(
                f"{where}: xnnpack dtype fp16 is for unquantized shards; {options['quantize']} shards compute in fp32 "
                "(use quantize none with dtype fp16, or dtype fp32)"
            )
        if options["attention"] not in XNNPACK_ATTENTION:
            raise UserError(
                f"{where}: xnnpack attention must be one of {', '.join(XNNPACK_ATTENTION)}, got {options['attention']!r}"
            )
        for key, allowed in (("head_quantize", XNNPACK_HEAD_QUANTIZE), ("weight_mapping", XNNPACK_WEIGHT_MAPPING)):
            if options[key] not in allowed:
                raise UserError(f"{where}: xnnpack {key} must be one of {', '.join(allowed)}, got {options[key]!r}")
        size = options["group_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UserError(f"{where}: group_size must be a non-negative integer (0 = per channel), got {size!r}")
    if backend == "qnn":
        if options["soc"] not in QNN_SOCS:
            raise UserError(
                f"{where}: unknown SoC {options['soc']!r}{suggest(str(options['soc']), QNN_SOCS)}; supported: {', '.join(QNN_SOCS)}"
            )
        if options["precision"] not in QNN_PRECISIONS:
            raise UserError(
                f"{where}: qnn precision must be one of {', '.join(QNN_PRECISIONS)}, got {options['precision']!r}"
            )
        for key in ("weight_sharing", "native_io"):
            if not isinstance(options[key], bool):
                raise UserError(f"{where}: qnn {key} must be true or false, got {options[key]!r}")
        _check_qnn_details(options, where)
        _check_qnn_arch(options, where)


def _check_qnn_details(options: dict, where: str) -> None:
    overrides = options.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise UserError(f"{where}: qnn overrides must map module names to precisions, e.g. {{output: 16a8w}}")
    for pattern, precision in overrides.items():
        if precision not in QNN_PRECISIONS[1:]:
            raise UserError(
                f"{where}: override for '{pattern}' must be a quantized precision "
                f"({', '.join(QNN_PRECISIONS[1:])}), got {precision!r}"
            )
        if options["precision"] == "fp16":
            raise UserError(f"{where}: overrides need a quantized precision for the shard, not fp16")
    calibration = options.get("calibration") or {}
    if not isinstance(calibration, dict):
        raise UserError(f"{where}: calibration must be a mapping with prompts, file or samples")
    check_keys(calibration, ("prompts", "file", "samples"), f"calibration of {where}")
    if "samples" in calibration:
        positive_int(calibration["samples"], f"{where}: calibration samples")
    if "prompts" in calibration and (not isinstance(calibration["prompts"], list) or not calibration["prompts"]):
        raise UserError(f"{where}: calibration prompts must be a non-empty list of strings")
    if options["rounding"] not in QNN_ROUNDINGS:
        raise UserError(f"{where}: qnn rounding must be one of {', '.join(QNN_ROUNDINGS)}, got {options['rounding']!r}")
    if options["block_size"] not in QNN_BLOCK_SIZES:
        raise UserError(
            f"{where}: qnn block_size must be one of {', '.join(map(str, QNN_BLOCK_SIZES))} input channels, "
            f"got {options['block_size']!r}"
        )
    budget = options.get("max_context_mb", 1024)
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
        raise UserError(f"{where}: qnn max_context_mb must be a positive number of megabytes, got {budget!r}")
    for key in ("skip_ops", "skip_node_ids"):
        value = options.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{where}: {key} must be a list of names, e.g. [aten.linear.default]")


def _check_qnn_arch(options: dict, where: str) -> None:
    """Every precision the shard uses (its own, its overrides') compiles for its SoC's HTP."""
    soc = options["soc"]
    for precision in (options["precision"], *(options.get("overrides") or {}).values()):
        runs_on = precision_runs_on(precision)
        if runs_on is not None and not runs_on(soc):
            oldest = min(htp_arch(other) for other in QNN_SOCS if runs_on(other))
            raise UserError(
                f"{where}: qnn precision {precision} needs an HTP of v{oldest} or newer; {soc}'s is "
                f"v{htp_arch(soc)} (use 16a4w or 16a8w there, or another SoC)"
            )


def positive_int(value, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
