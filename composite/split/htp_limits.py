"""What a QNN shard holds on the Hexagon NPU, and the limits it has to fit.

The limits (Qualcomm's and ExecuTorch's public material, cited in docs/placement.md, "The HTP's
memory limits"; no QNN document states them as numbers):
- One process's QNN contexts share the HTP's 32-bit virtual address space: every context's
  weights, the spill-fill buffer and the I/O buffers mapped to the NPU come out of it. PROCESS_MIB
  is the 3.5 GB ONNX Runtime's QNN provider splits models at: what all QNN shards of an export may
  take together.
- One context: CONTEXT_MIB, the default of `qnn.max_context_mb`, is 1024 MiB, above the context
  binaries Qualcomm and ExecuTorch ship for their LLMs.

Sizes are estimated from the shapes before anything is lowered (weights at the precision's bytes
per weight, the I/O tensors at its activation width) and measured after (the context binaries'
bytes, the spill-fill size QNN reports).
"""

from __future__ import annotations

from dataclasses import dataclass

from composite.errors import UserError
from composite.manifest import every_row_logits
from composite.model.llama import cache_shapes
from composite.units import MIB

PROCESS_MIB = 3584
CONTEXT_MIB = 1024
# bytes per weight; 16a4w_block adds a byte per block (QNN stores each block's 4-bit scale in 8 bits)
WEIGHT_BYTES = {"fp16": 2.0, "16a16w": 2.0, "16a8w": 1.0, "8a8w": 1.0, "16a4w": 0.5, "16a4w_block": 0.5}
ACTIVATION_BYTES = {"fp16": 2, "16a16w": 2, "16a8w": 2, "8a8w": 1, "16a4w": 2, "16a4w_block": 2}


@dataclass
class HtpBytes:
    weights: int
    spill_fill: int
    io: int

    @property
    def total(self) -> int:
        return self.weights + self.spill_fill + self.io

    def describe(self) -> str:
        return (
            f"{self.total / MIB:.1f} MiB (weights {self.weights / MIB:.1f}, spill-fill {self.spill_fill / MIB:.1f}, "
            f"I/O {self.io / MIB:.1f})"
        )


def precision_bytes(precision: str, block_size: int) -> float:
    """Bytes per weight at `precision`, its block scales included."""
    return WEIGHT_BYTES[precision] + (1 / block_size if precision == "16a4w_block" else 0)


def weight_bytes_per_param(options: dict) -> float:
    """The widest weights the shard's precision or any of its overrides gives (an upper bound)."""
    precisions = [options["precision"], *(options.get("overrides") or {}).values()]
    return max(precision_bytes(p, options.get("block_size", 32)) for p in precisions)


def layer_weight_bytes(args, options: dict) -> int:
    d, hd = args.dim, args.head_dim
    params = d * hd * (2 * args.n_heads + 2 * args.n_kv_heads) + 3 * d * args.hidden_dim
    # per-output-channel scales and offsets (8 bytes a channel) beside the weights
    channels = hd * (args.n_heads + 2 * args.n_kv_heads) + d + 2 * args.hidden_dim + d
    return int(params * weight_bytes_per_param(options)) + 8 * channels


def fixed_weight_bytes(args, spec, options: dict) -> int:
    """The embedding and the head, where the shard holds them."""
    per_param = weight_bytes_per_param(options)
    table = args.vocab_size * args.dim
    return int(per_param * table) * (spec.has_embedding + spec.has_head)


def io_bytes(args, spec, options: dict, max_seq_len: int, methods: dict[str, int]) -> int:
    """The tensors the shard takes and gives, in its activation width: the caches of its layers
    once (every method binds the same cache), the rest per method (`methods`: name -> tokens per
    call)."""
    width = ACTIVATION_BYTES[options["precision"]]
    k_shape, v_shape = cache_shapes(args, max_seq_len)
    cache = len(spec.layers) * (_count(k_shape) + _count(v_shape))
    per_method = 0
    for method, tokens in methods.items():
        new_k, new_v = cache_shapes(args, tokens)
        hidden = tokens * args.dim * (not spec.has_embedding) + tokens * args.dim * (not spec.has_head)
        logits = args.vocab_size * (tokens if every_row_logits(method) else 1) if spec.has_head else 0
        mask = tokens * (max_seq_len + tokens) if len(spec.layers) else 0
        per_method += hidden + logits + mask + len(spec.layers) * (_count(new_k) + _count(new_v))
    return width * (cache + per_method)


def _count(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def estimate(args, spec, options: dict, max_seq_len: int, methods: dict[str, int]) -> HtpBytes:
    """A QNN shard's HTP bytes from its shapes (the spill-fill size is known only once compiled).
    Without weight sharing (the host twin) each of its methods keeps its own weights."""
    copies = 1 if options.get("weight_sharing", True) else len(methods)
    weights = copies * (fixed_weight_bytes(args, spec, options) + len(spec.layers) * layer_weight_bytes(args, options))
    return HtpBytes(weights, 0, io_bytes(args, spec, options, max_seq_len, methods))


def context_limit(options: dict) -> int:
    return int(options.get("max_context_mb", CONTEXT_MIB) * MIB)


def layer_capacity(args, spec, options: dict, max_seq_len: int, methods: dict[str, int]) -> int:
    """How many decoder layers a QNN shard in `spec`'s place (its embedding, its head) can hold
    within qnn.max_context_mb."""
    empty = estimate(
        args, type(spec)(spec.index, 0, 0, spec.has_embedding, spec.has_head), options, max_seq_len, methods
    )
    one_layer = type(spec)(spec.index, 0, 1, spec.has_embedding, spec.has_head)
    per_layer = estimate(args, one_layer, options, max_seq_len, methods).total - empty.total
    room = context_limit(options) - empty.total
    return max(0, room // per_layer)


def check_placement(args, specs, placements, max_seq_len: int, methods: dict[str, int]) -> dict[int, HtpBytes]:
    """Each QNN shard's estimated HTP bytes; one line and exit 2 where a shard exceeds its
    context budget or the QNN shards together exceed what one process's HTP address space holds."""
    estimates = {}
    for spec, placement in zip(specs, placements):
        if placement.backend != "qnn":
            continue
        options = placement.options
        bytes_ = estimate(args, spec, options, max_seq_len, methods)
        estimates[spec.index] = bytes_
        limit = context_limit(options)
        if bytes_.total > limit:
            raise UserError(
                f"QNN shard {spec.index} ({len(spec.layers)} layers at {options['precision']}) needs about "
                f"{bytes_.describe()} on the HTP, more than qnn.max_context_mb {limit // MIB}; give it fewer layers "
                "(more shards, or layers_per_shard: auto)"
            )
    total = sum(b.total for b in estimates.values())
    if total > PROCESS_MIB * MIB:
        raise UserError(
            f"the QNN shards need about {total / MIB:.0f} MiB on the HTP together, more than the {PROCESS_MIB} MiB one "
            "process's HTP address space holds for them; place fewer layers on QNN or quantize them further"
        )
    return estimates
