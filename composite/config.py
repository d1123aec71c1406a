"""The export configuration: YAML file + command-line overrides, validated before any work starts.

YAML keys (all optional):
  checkpoint, params, tokenizer   paths; no checkpoint means the embedded default (a checkpoint is
                                  a Meta .pth, a Hugging Face folder or a llama GGUF file)
  chat_template                   a Jinja chat template file, instead of the tokenizer's own
  max_seq_len                     KV cache length (positions), default 512
  prefill_len                     tokens per call of each shard's prefill method, default 64
  verify_len                      tokens per call of each shard's verify method, default 8 (0:
                                  none): guesses checked in one call (--lookahead,
                                  --prompt-lookup in the runners)
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

import os
import sys
from dataclasses import dataclass, field

import yaml

from composite.errors import UserError
from composite.manifest import method_widths
from composite.placement_options import (
    BACKEND_OPTION_KEYS,
    BACKENDS,
    DEFAULT_OPTIONS,
    check_backend_options,
    check_keys,
    positive_int,
    suggest,
)

ROTATIONS = ("none", "hadamard", "hadamard-ffn")  # composite/model/rotation.py

TOP_LEVEL_KEYS = (
    "checkpoint",
    "params",
    "tokenizer",
    "chat_template",
    "max_seq_len",
    "prefill_len",
    "verify_len",
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
    verify_len: int = 8
    shards: int = 1
    layers_per_shard: list[int] | str | None = None  # a count per shard, "auto", or None (balanced)
    placement: object = "xnnpack"  # as written; resolved by `placements()`
    xnnpack: dict = field(default_factory=dict)
    qnn: dict = field(default_factory=dict)
    embedding_quantize: object = "none"  # as written; parsed by `embedding_bits_and_group()`
    rotate: str = "auto"  # as written; resolved by `rotation()`
    max_memory_gb: float | None = None
    output: str = "artifacts"

    def methods(self) -> dict[str, int]:
        """Every shard's methods and their widths (manifest.method_widths)."""
        return method_widths(self.prefill_len, self.verify_len)

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
                f"unknown backend '{backend}' in {where}{suggest(str(backend), BACKENDS)} (known: {', '.join(BACKENDS)})"
            )
        check_keys(overrides, BACKEND_OPTION_KEYS[backend], where)
        section = {"xnnpack": self.xnnpack, "qnn": self.qnn}.get(backend, {})
        options = {**DEFAULT_OPTIONS[backend], **section, **overrides}
        check_backend_options(backend, options, where)
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
    check_keys(data, TOP_LEVEL_KEYS, f"config {yaml_path}")
    for section in ("xnnpack", "qnn"):
        if section in data:
            if not isinstance(data[section], dict):
                raise UserError(f"'{section}' in config {yaml_path} must be a mapping")
            check_keys(data[section], BACKEND_OPTION_KEYS[section], f"'{section}' of config {yaml_path}")
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
    config.shards = positive_int(config.shards, "shards")
    config.max_seq_len = positive_int(config.max_seq_len, "max_seq_len", 2)
    config.prefill_len = positive_int(config.prefill_len, "prefill_len")
    if config.prefill_len > config.max_seq_len:
        raise UserError(f"prefill_len {config.prefill_len} exceeds max_seq_len {config.max_seq_len}")
    config.verify_len = positive_int(config.verify_len, "verify_len", 0)
    if config.verify_len == 1 or config.verify_len > config.max_seq_len:
        raise UserError(
            f"verify_len {config.verify_len} must be 0 (no verify method) or 2 .. max_seq_len {config.max_seq_len}"
        )
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
