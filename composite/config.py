"""The export configuration: YAML file + command-line overrides, validated before any work starts.

YAML keys (all optional):
  checkpoint, params, tokenizer   paths; no checkpoint means the embedded default (a checkpoint is
                                  a Meta .pth, a Hugging Face folder or a llama GGUF file)
  chat_template                   a Jinja chat template file, instead of the tokenizer's own
  max_seq_len                     KV cache length (positions), default 512
  prefill_len                     tokens per call of each shard's prefill method, default 64
  shards                          number of shards, default 1
  layers_per_shard                explicit decoder-layer count per shard, or auto: the QNN shards
                                  take as many layers as fit qnn.max_context_mb, spread evenly,
                                  the CPU shards the rest, balanced by bytes; default: every shard
                                  balanced by bytes
  placement                       backend per shard: one name for all, a list, or a mapping
                                  {default: xnnpack, 2: qnn}; list items may be mappings with
                                  per-shard options, e.g. {backend: xnnpack, quantize: 8da4w}
  xnnpack: {quantize, dtype, ...} defaults for XNNPACK shards (quantize: none | 8da4w | 8da8w;
                                  dtype: fp32 | fp16; group_size; attention: kernel | graph;
                                  head_quantize: 8da8w | same | none, the head's weights in a
                                  quantized shard; weight_mapping: symmetric_no_clipping_err |
                                  symmetric, how torchao picks the weight scales)
  qnn: {soc, precision, ...}      defaults for QNN shards (weight_sharing: true by default; the
                                  x86 simulator needs false, as --no-weight-sharing sets;
                                  max_context_mb: a QNN shard's HTP budget, default 1024:
                                  split/htp_limits.py; precision 16a4w_block: 4-bit weights
                                  in blocks of block_size input channels, 16, 32 (default) or
                                  64, rounded as rounding says, gptq (default) or nearest)
  embedding_quantize              "none" (default), "8,0" (8-bit, a scale per row) or "4,32"
                                  (4-bit, a scale per 32 columns): BITS,GROUP as ExecuTorch's
                                  export_llama --embedding-quantize spells it
  rotate                          auto (default) | none | hadamard | hadamard-ffn: the residual
                                  stream rotated by a randomized Hadamard matrix folded into the
                                  weights (composite/model/rotation.py); the same model in float,
                                  easier to quantize. hadamard-ffn also rotates each feed-forward's
                                  hidden activation at run time (two small matmuls a layer).
                                  auto: none where some weights are 8da4w or 16a4w; hadamard-ffn
                                  where some are 16a4w_block, or all are 8-bit (QNN 16-bit too)
                                  and on XNNPACK; hadamard where all are 8-bit and some on QNN;
                                  none where nothing is quantized (auto_rotation)
  max_memory_gb                   what the export's lowering jobs may hold at once (default: 90% of
                                  the memory available when it starts); jobs run side by side only
                                  within it, and a shard expected to need more is refused up front
  output                          artifacts folder, default "artifacts"
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field

import yaml

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
QNN_BLOCK_SIZES = (16, 32, 64)
QNN_ROUNDINGS = (
    "nearest",
    "gptq",
)  # of 4-bit weights onto their grid  # input channels per block of 16a4w_block (LPBQ) weights
ROTATIONS = ("none", "hadamard", "hadamard-ffn")  # composite/model/rotation.py

TOP_LEVEL_KEYS = (
    "checkpoint",
    "params",
    "tokenizer",
    "chat_template",
    "max_seq_len",
    "prefill_len",
    "shards",
    "layers_per_shard",
    "placement",
    "xnnpack",
    "qnn",
    "embedding_quantize",
    "rotate",
    "max_memory_gb",
    "output",
)
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


@dataclass(frozen=True)
class Placement:
    backend: str
    options: dict = field(default_factory=dict, hash=False)

    def describe(self) -> str:
        extras = [
            str(v)
            for k, v in self.options.items()
            if (k in ("quantize", "precision") and v != "none") or (k == "dtype" and v != "fp32")
        ]
        return "+".join([self.backend, *extras])

    @property
    def quantized_qnn(self) -> bool:
        """A QNN shard with fixed-point activations (calibrated), not fp16."""
        return self.backend == "qnn" and self.options["precision"] != "fp16"


@dataclass
class ExportConfig:
    checkpoint: str | None = None
    params: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    max_seq_len: int = 512
    prefill_len: int = 64
    shards: int = 1
    layers_per_shard: list[int] | str | None = None  # a count per shard, "auto", or None (balanced)
    placement: object = "xnnpack"  # as written; resolved by `placements()`
    xnnpack: dict = field(default_factory=dict)
    qnn: dict = field(default_factory=dict)
    embedding_quantize: object = "none"  # as written; parsed by `embedding_bits_and_group()`
    rotate: str = "auto"  # as written; resolved by `rotation()`
    max_memory_gb: float | None = None
    output: str = "artifacts"

    def rotation(self) -> str:
        """The rotation (one of ROTATIONS) with auto resolved by auto_rotation, from the quantized
        weights of every shard."""
        if self.rotate != "auto":
            return self.rotate
        quantized = []
        for placement in self.placements():
            options = placement.options
            if placement.backend == "xnnpack" and options["quantize"] != "none":
                quantized.append(("xnnpack", options["quantize"]))
            elif placement.quantized_qnn:
                quantized += [("qnn", p) for p in (options["precision"], *(options.get("overrides") or {}).values())]
        return auto_rotation(quantized)

    def embedding_bits_and_group(self) -> tuple[int, int] | None:
        """(bits, group size; 0 = one scale per row) of the quantized embedding, or None."""
        text = str(self.embedding_quantize).strip()
        if text in ("none", ""):
            return None
        parts = [p.strip() for p in text.split(",")]
        try:
            bits, group = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError:
            bits, group = None, None
        if len(parts) > 2 or bits not in (4, 8) or group is None or group < 0:
            raise UserError(
                f"embedding_quantize must be none or BITS,GROUP with BITS 4 or 8 and GROUP >= 0 "
                f"(0 = a scale per row), e.g. 8,0 or 4,32; got {self.embedding_quantize!r}"
            )
        return bits, group

    def placements(self) -> list[Placement]:
        """One resolved Placement per shard."""
        n = self.shards
        spec = self.placement
        if isinstance(spec, str):
            entries = [spec] * n
        elif isinstance(spec, list):
            if len(spec) != n:
                raise UserError(f"placement lists {len(spec)} backends but there are {n} shards")
            entries = list(spec)
        elif isinstance(spec, dict):
            default = spec.get("default", "xnnpack")
            entries = [default] * n
            for key, value in spec.items():
                if key == "default":
                    continue
                if not isinstance(key, int) or isinstance(key, bool):
                    raise UserError(f"placement key {key!r} must be a shard index or 'default'")
                if not 0 <= key < n:
                    raise UserError(f"placement names shard {key}, but there are only {n} shards (0 to {n - 1})")
                entries[key] = value
        else:
            raise UserError("placement must be a backend name, a list, or a mapping of shard index to backend")
        return [self._resolve(i, entry) for i, entry in enumerate(entries)]

    def _resolve(self, index: int, entry) -> Placement:
        where = f"placement of shard {index}"
        if isinstance(entry, str):
            backend, overrides = entry, {}
        elif isinstance(entry, dict):
            if "backend" not in entry:
                raise UserError(f"{where} needs a 'backend' key")
            backend = entry["backend"]
            overrides = {k: v for k, v in entry.items() if k != "backend"}
        else:
            raise UserError(f"{where} must be a backend name or a mapping, got {entry!r}")
        if backend not in BACKENDS:
            raise UserError(
                f"unknown backend '{backend}' in {where}{_suggest(str(backend), BACKENDS)} (known: {', '.join(BACKENDS)})"
            )
        _check_keys(overrides, BACKEND_OPTION_KEYS[backend], where)
        section = {"xnnpack": self.xnnpack, "qnn": self.qnn}.get(backend, {})
        options = {**DEFAULT_OPTIONS[backend], **section, **overrides}
        _check_backend_options(backend, options, where)
        return Placement(backend, options)


def auto_rotation(quantized: list[tuple[str, str]]) -> str:
    """The rotation `rotate: auto` gives a recipe whose quantized weights are `quantized`
    ((backend, precision) pairs), as the rotations' KL divergence was measured (docs/quality.md,
    Results): none where some weights are 4-bit in groups or per channel (8da4w, 16a4w: SmolLM2's
    weights sit on a 4-bit grid of the unrotated basis); hadamard-ffn where QNN's block-wise 4-bit
    (16a4w_block) is among them, or where every quantized weight is 8-bit (QNN's 16 too) and
    XNNPACK's; hadamard where they are 8-bit and some are QNN's; none where nothing is quantized."""
    if not quantized or any(p in ("8da4w", "16a4w") for _, p in quantized):
        return "none"
    if any(p == "16a4w_block" for _, p in quantized) or all(b == "xnnpack" for b, _ in quantized):
        return "hadamard-ffn"
    return "hadamard"


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_keys(mapping: dict, allowed, where: str) -> None:
    for key in mapping:
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise UserError(f"unknown key '{key}' in {where}{_suggest(str(key), allowed)}; valid keys: {valid}")


def _check_backend_options(backend: str, options: dict, where: str) -> None:
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
                f"{where}: unknown SoC {options['soc']!r}{_suggest(str(options['soc']), QNN_SOCS)}; supported: {', '.join(QNN_SOCS)}"
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
    _check_keys(calibration, ("prompts", "file", "samples"), f"calibration of {where}")
    if "samples" in calibration:
        _positive_int(calibration["samples"], f"{where}: calibration samples")
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


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"config {path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config {path} is not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid syntax"
        raise UserError(f"config {path} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config {path} must be a mapping of keys to values")
    return data


def build_config(yaml_path: str | None, overrides: dict) -> ExportConfig:
    """YAML values, then command-line overrides (those not None), validated."""
    data = load_yaml(yaml_path) if yaml_path else {}
    _check_keys(data, TOP_LEVEL_KEYS, f"config {yaml_path}")
    for section in ("xnnpack", "qnn"):
        if section in data:
            if not isinstance(data[section], dict):
                raise UserError(f"'{section}' in config {yaml_path} must be a mapping")
            _check_keys(data[section], BACKEND_OPTION_KEYS[section], f"'{section}' of config {yaml_path}")
    values = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    placement_in_yaml = data.get("placement") if overrides.get("placement") is None else None
    shards_flag = overrides.get("shards")
    if shards_flag is not None and isinstance(placement_in_yaml, list) and len(placement_in_yaml) != shards_flag:
        raise UserError(
            f"--shards {overrides['shards']} conflicts with the config's placement of "
            f"{len(data['placement'])} shards; pass --placement too"
        )
    if "shards" not in values and isinstance(values.get("layers_per_shard"), list):
        values["shards"] = len(values["layers_per_shard"])  # one entry per shard says how many
    if values.get("output") == "":
        raise UserError("output is empty: name the artifacts folder (default: artifacts)")
    config = ExportConfig(**values)
    # Paths are relative to the working directory, as on the command line.
    for key in ("checkpoint", "params", "tokenizer", "chat_template", "output"):
        if getattr(config, key) is not None:
            setattr(config, key, os.path.expanduser(str(getattr(config, key))))
    config.shards = _positive_int(config.shards, "shards")
    config.max_seq_len = _positive_int(config.max_seq_len, "max_seq_len", 2)
    config.prefill_len = _positive_int(config.prefill_len, "prefill_len")
    if config.prefill_len > config.max_seq_len:
        raise UserError(f"prefill_len {config.prefill_len} exceeds max_seq_len {config.max_seq_len}")
    if (
        config.layers_per_shard is not None
        and config.layers_per_shard != "auto"
        and (
            not isinstance(config.layers_per_shard, list)
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in config.layers_per_shard)
        )
    ):
        raise UserError("layers_per_shard must be a list of integers, one per shard, or auto")
    if config.layers_per_shard == "auto" and not any(p.backend == "qnn" for p in config.placements()):
        raise UserError("layers_per_shard auto cuts by the QNN shards' HTP budget; this placement has no QNN shard")
    config.placements()  # validate now, before any slow work
    if config.max_memory_gb is not None and (
        not isinstance(config.max_memory_gb, (int, float))
        or isinstance(config.max_memory_gb, bool)
        or config.max_memory_gb <= 0
    ):
        raise UserError(f"max_memory_gb must be a positive number of gigabytes, got {config.max_memory_gb!r}")
    if config.rotate not in ("auto", *ROTATIONS):
        raise UserError(f"rotate must be one of auto, {', '.join(ROTATIONS)}; got {config.rotate!r}")
    quantized_embedding = config.embedding_bits_and_group()
    if quantized_embedding is not None and config.placements()[0].backend == "qnn":
        raise UserError(
            "embedding_quantize is for an embedding shard on xnnpack or portable; shard 0 is a QNN shard, "
            "whose precision quantizes its embedding"
        )
    return config


def check_group_sizes(args, placements: list) -> None:
    """8da4w groups must divide a linear's input width, or that linear stays fp32: say so before
    any lowering, and refuse a group size that would leave every linear unquantized."""
    widths = {"dim": args.dim, "hidden_dim": args.hidden_dim, "n_heads x head_dim": args.n_heads * args.head_dim}
    for group in sorted(
        {
            p.options["group_size"]
            for p in placements
            if p.backend == "xnnpack" and p.options["quantize"] == "8da4w" and p.options["group_size"]
        }
    ):
        misfits = {name: width for name, width in widths.items() if width % group}
        described = ", ".join(f"{name} {width}" for name, width in misfits.items())
        if len(misfits) == len(widths):
            raise UserError(
                f"--group-size {group} divides none of this model's linear input widths ({described}): "
                "nothing would be quantized; choose a divisor of them (e.g. 32), or 0 for per channel"
            )
        if misfits:
            print(f"warning: group size {group} does not divide {described}: those linears stay fp32", file=sys.stderr)
