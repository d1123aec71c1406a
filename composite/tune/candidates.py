"""What the tuner chooses between, and what each choice costs in bytes.

A tuned recipe cuts the model into groups and gives each group its own shard: the embedding
(shard 0, on the CPU), runs of decoder layers (one shard each), and the head (final norm and output
linear, the last shard). A layer group or the head takes a candidate, a backend and a precision
("qnn:16a4w", "xnnpack:8da4w"); the embedding takes one of the export's embedding_quantize settings;
the head's candidates can be fewer than the layers' (--head), as a recipe that fixes its head.
A group finer than a shard would need per-module precision inside an XNNPACK shard, which the
export does not have: finer groups are more shards (--shards).

Bytes are the weights as the backends store them, from the shapes and the quantization formula:
  xnnpack fp32    4 per weight
  xnnpack 8da8w   1 per weight + a float32 scale per output channel
  xnnpack 8da4w   1/2 per weight + a bfloat16 scale per group of group_size inputs (a linear whose
                  input width the group does not divide stays fp32, as the export leaves it)
  qnn fp16        2 per weight
  qnn 16a8w, 8a8w 1 per weight + a float32 scale and an int32 offset per output channel
  qnn 16a4w       1/2 per weight + the same per channel
  qnn 16a4w_block 1/2 per weight + a byte per block of 32 inputs (its 4-bit scale) + the same per
                  channel (a linear whose input width 32 does not divide: as 16a4w)
  norms           4 per weight (2 in qnn fp16)
  embedding       none: 4 per weight; "8,0": 1 per weight + a float16 scale per row; "4,32": 1/2 per
                  weight + a float16 scale per 32 columns
The bytes a decode step reads are the same for layers and head (every weight, every token), and one
row for the embedding: a proxy for memory-bound decode speed, not a phone measurement.
A tied table whose lookup is "8,0" and whose head is XNNPACK's 8da8w, unrotated, is stored once
(lowering/shared_table.py): such a recipe does not store the lookup's bytes (table_stored_once).
"""

from __future__ import annotations

from dataclasses import dataclass

from composite.config import ExportConfig
from composite.errors import UserError
from composite.lowering import shared_table
from composite.lowering.qnn.quantizer import rotation_precision
from composite.model.llama import ModelArgs
from composite.model.rotation import hidden_rotation_sizes
from composite.placement_options import DEFAULT_OPTIONS, QNN_PRECISIONS

EMBEDDING_PLACEMENT = {"backend": "xnnpack"}  # a tuned recipe's lookup shard: the CPU's
DEFAULT_CANDIDATES = "qnn:fp16,qnn:16a8w,qnn:16a4w_block,qnn:16a4w,qnn:8a8w,xnnpack:fp32,xnnpack:8da8w,xnnpack:8da4w"
XNNPACK_PRECISIONS = ("fp32", "8da8w", "8da4w")
TUNED_QNN_PRECISIONS = tuple(p for p in QNN_PRECISIONS if p != "16a16w")  # 16a16w: no smaller than fp16
EMBEDDING_CHOICES = ("none", "8,0", "4,32")
QNN_BLOCK = DEFAULT_OPTIONS["qnn"]["block_size"]  # the tuner's 16a4w_block candidates use the default blocks
DEFAULT_EMBEDDING = "|".join(EMBEDDING_CHOICES)


@dataclass(frozen=True)
class Candidate:
    backend: str  # "qnn" | "xnnpack"
    precision: str  # a QNN precision, or fp32 | 8da8w | 8da4w for XNNPACK

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.precision}"

    @property
    def is_float(self) -> bool:
        return self.backend == "xnnpack" and self.precision == "fp32"

    @property
    def quantized_qnn(self) -> bool:
        """A QNN candidate with fixed-point activations (calibrated), as Placement.quantized_qnn."""
        return self.backend == "qnn" and self.precision != "fp16"

    def placement(self, head: bool) -> dict:
        """The shard's placement entry in an export config (a head shard keeps the precision of
        its candidate: an XNNPACK head quantized as 8da4w is a 4-bit head)."""
        if self.backend == "qnn":
            return {"backend": "qnn", "precision": self.precision}
        if self.precision == "fp32":
            return {"backend": "xnnpack"}
        entry = {"backend": "xnnpack", "quantize": self.precision}
        if head:
            entry["head_quantize"] = "same"
        return entry


def parse_candidates(text: str) -> list[Candidate]:
    out = []
    for item in (s.strip() for s in text.split(",")):
        backend, _, precision = item.partition(":")
        allowed = TUNED_QNN_PRECISIONS if backend == "qnn" else XNNPACK_PRECISIONS if backend == "xnnpack" else ()
        if precision in allowed:
            out.append(Candidate(backend, precision))
        else:
            raise UserError(
                f"unknown candidate '{item}': candidates are qnn:{'|'.join(TUNED_QNN_PRECISIONS)} and "
                f"xnnpack:{'|'.join(XNNPACK_PRECISIONS)}, comma separated"
            )
    if len(set(out)) != len(out):
        raise UserError(f"--candidates names a candidate twice: {text}")
    return out


def parse_embedding(text: str) -> list[str]:
    choices = [s.strip() for s in text.split("|")]
    for choice in choices:
        if choice not in EMBEDDING_CHOICES:
            raise UserError(
                f"unknown embedding choice '{choice}': choose among {', '.join(EMBEDDING_CHOICES)}, "
                "separated by | (e.g. '8,0|4,32|none')"
            )
    return list(dict.fromkeys(choices))


@dataclass(frozen=True)
class Group:
    kind: str  # "embedding" | "layers" | "head"
    index: int  # its shard's index in the tuned recipe
    layer_start: int = 0
    layer_end: int = 0

    @property
    def name(self) -> str:
        if self.kind == "layers":
            return f"layers {self.layer_start}-{self.layer_end - 1}"
        return self.kind


def plan_groups(args: ModelArgs, shards: int) -> list[Group]:
    """The embedding, shards - 2 runs of layers as even as the layer count allows, the head."""
    if shards < 3:
        raise UserError(f"--shards {shards}: a tuned recipe needs at least 3 (embedding, layers, head)")
    runs = shards - 2
    if runs > args.n_layers:
        raise UserError(
            f"--shards {shards} is too many for {args.n_layers} layers: at most {args.n_layers + 2} "
            "(embedding, one layer per shard, head)"
        )
    groups, start = [Group("embedding", 0)], 0
    for i in range(runs):
        count = args.n_layers // runs + (1 if i < args.n_layers % runs else 0)
        groups.append(Group("layers", i + 1, start, start + count))
        start += count
    groups.append(Group("head", shards - 1))
    return groups


def layer_linears(args: ModelArgs) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's linears."""
    d, hd, h = args.dim, args.head_dim, args.hidden_dim
    return [
        (args.n_heads * hd, d),
        (args.n_kv_heads * hd, d),
        (args.n_kv_heads * hd, d),
        (d, args.n_heads * hd),
        (h, d),
        (h, d),
        (d, h),
    ]


def linear_bytes(
    out_features: int, in_features: int, candidate: Candidate, group_size: int, qnn_block: int = QNN_BLOCK
) -> int:
    n = out_features * in_features
    if candidate.backend == "xnnpack":
        if candidate.precision == "fp32":
            return 4 * n
        if candidate.precision == "8da8w":
            return n + 4 * out_features
        if group_size and in_features % group_size:
            return 4 * n  # left in fp32 by the export
        groups = in_features // group_size if group_size else 1
        return n // 2 + 2 * out_features * groups
    if candidate.precision == "fp16":
        return 2 * n
    per_channel = 8 * out_features
    if candidate.precision == "16a4w_block" and in_features % qnn_block == 0:
        return n // 2 + n // qnn_block + per_channel
    if candidate.precision == "16a16w":
        return 2 * n + per_channel
    return (n // 2 if candidate.precision.startswith("16a4w") else n) + per_channel


def norm_bytes(dim: int, candidate: Candidate) -> int:
    return (2 if candidate.backend == "qnn" and candidate.precision == "fp16" else 4) * dim


def group_bytes(
    group: Group, choice, args: ModelArgs, group_size: int, rotation: str = "none", qnn_block: int = QNN_BLOCK
) -> tuple[int, int]:
    """(stored bytes, bytes one decode step reads) of `group` under `choice` (a Candidate, or an
    embedding_quantize string for the embedding), the model rotated as `rotation` says, QNN's
    block-wise weights in blocks of `qnn_block` input channels."""
    vocab, dim = args.vocab_size, args.dim
    if group.kind == "embedding":
        if choice == "none":
            return 4 * vocab * dim, 4 * dim
        if choice == "8,0":
            return vocab * dim + 2 * vocab, dim + 2
        return vocab * dim // 2 + 2 * vocab * dim // 32, dim // 2 + 2 * dim // 32
    if group.kind == "head":
        stored = linear_bytes(vocab, dim, choice, group_size, qnn_block) + norm_bytes(dim, choice)
        return stored, stored
    per_layer = sum(linear_bytes(o, i, choice, group_size, qnn_block) for o, i in layer_linears(args)) + 2 * norm_bytes(
        dim, choice
    )
    if rotation == "hadamard-ffn":  # the feed-forward's online rotation: float on XNNPACK, quantized on QNN
        sizes = hidden_rotation_sizes(args.hidden_dim)
        if choice.backend == "xnnpack":
            per_layer += sum(4 * n * n for n in sizes)
        else:
            rotation_choice = Candidate("qnn", rotation_precision(choice.precision))
            per_layer += sum(linear_bytes(n, n, rotation_choice, 0) for n in sizes)
    stored = per_layer * (group.layer_end - group.layer_start)
    return stored, stored


def table_stored_once(embedding, head, args: ModelArgs, rotation: str) -> int:
    """The bytes a recipe with this lookup and head does not store: the lookup's own when the
    export keeps the tied table once for their config (lowering/shared_table.head_mapping decides;
    a tuned config's first and last shards as tune/output.tuned_config writes them), else 0."""
    placement = [dict(EMBEDDING_PLACEMENT), head.placement(head=True)]
    config = ExportConfig(shards=2, placement=placement, embedding_quantize=embedding, rotate=rotation)
    if shared_table.head_mapping(args, config, config.placements()) is None:
        return 0
    return group_bytes(Group("embedding", 0), embedding, args, 0)[0]


def choice_name(choice) -> str:
    return choice.name if isinstance(choice, Candidate) else f"embedding {choice}"


def choices_for(group: Group, candidates: list[Candidate], embedding: list[str], head: list[Candidate]) -> list:
    if group.kind == "embedding":
        return embedding
    return head if group.kind == "head" else candidates
