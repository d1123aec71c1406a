"""XNNPACK: fp32 or fp16, or 8-bit dynamic activations with 4-bit grouped (8da4w) or 8-bit
per-channel (8da8w) weights (torchao).

fp16 (`dtype: fp16`): weights, activations, hidden-state and KV-cache I/O in float16, as an fp16
QNN shard has them (composite/lowering/native_io.py's HalfIO); rotary angles are still computed in
float32, the mask stays float32 and logits come back as float32. XNNPACK computes in fp16 where
the CPU has fp16 arithmetic and converts to fp32 elsewhere.

Decode attention runs in our composite::attention kernel, which reads only the valid cache slots
(`attention: kernel`, the default; composite/ops/attention.py), with the projections around it in
XNNPACK; or it stays in the graph as masked matmuls over every slot (`attention: graph`). Prefill
keeps the graph's batched matmuls either way."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from composite.lowering import native_io, shared_table, torchao_weights
from composite.lowering.embedding import QuantizedEmbedding
from composite.lowering.program import BackendLowering, export_methods, finish, timed
from composite.lowering.work import ShardWork, load_shard
from composite.model.llama import Attention, FeedForward, RMSNorm, rope_cos_sin


class XnnpackRMSNorm(nn.Module):
    """RMSNorm with mean(x^2) as a matmul by a constant column. XNNPACK has no mean over the
    last dimension of a 3-D tensor; left to ExecuTorch's CPU kernel, every norm would cut a layer
    into separate delegate calls. x is scaled by 1/sqrt(dim) before it is squared."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight
        dim = norm.weight.shape[0]
        self.scale = 1.0 / math.sqrt(dim)
        self.register_buffer("sum_column", torch.ones((dim, 1)), persistent=False)

    def forward(self, x):
        scaled = x * self.scale
        return x * torch.rsqrt((scaled * scaled) @ self.sum_column + self.eps) * self.weight


class PeakScaledRMSNorm(nn.Module):
    """RMSNorm for float16, whose squares overflow past 256: each row is divided by its largest
    magnitude before it is squared, so no square exceeds 1 and their mean cannot overflow, whatever
    the activation (trained models carry single values of ~25,000 in their residual stream; any
    fixed prescale either overflows on those or loses ordinary rows to underflow).
    x * rsqrt(mean(x^2) + eps) = y * rsqrt(mean(y^2) + (sqrt(eps) / peak)^2) with y = x / peak;
    the peak's floor of 2^-10 keeps that last term below 11 and rows of zeros finite."""

    PEAK_FLOOR = 2.0**-10

    def __init__(self, norm: RMSNorm | XnnpackRMSNorm):
        super().__init__()
        self.weight = norm.weight
        dim = norm.weight.shape[0]
        self.register_buffer("mean_column", torch.full((dim, 1), 1.0 / dim), persistent=False)
        self.register_buffer("sqrt_eps", torch.full((1,), math.sqrt(norm.eps)), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        # XNNPACK reduces the last dimension of a 4-D tensor only (as a max pooling).
        peak = torch.max(torch.abs(x).view(b, 1, t, d), dim=3, keepdim=True)[0].view(b, t, 1)
        peak = torch.clamp(peak, min=self.PEAK_FLOOR)
        y = x / peak
        floor = self.sqrt_eps / peak
        return y * torch.rsqrt((y * y) @ self.mean_column + floor * floor) * self.weight


class HalfRope(nn.Module):
    """cos/sin of the rotary angles computed in float32 (float16 angles lose whole radians at
    positions in the hundreds) and handed to the float16 layers in float16."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def forward(self, positions):
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        return cos.half(), sin.half()


class XnnpackFeedForward(nn.Module):
    """FeedForward with SiLU written as x * sigmoid(x): PyTorch's decomposition of silu on float16
    computes in float32, and the two casts around it would cut every fp16 layer into more
    delegate calls."""

    def __init__(self, feed_forward: FeedForward):
        super().__init__()
        self.w1, self.w2, self.w3 = feed_forward.w1, feed_forward.w2, feed_forward.w3
        self.hidden_rotation = feed_forward.hidden_rotation

    def forward(self, x):
        gate = self.w1(x)
        return FeedForward.down(self, gate * torch.sigmoid(gate) * self.w3(x))


class KernelAttention(nn.Module):
    """Attention.forward with scores, softmax and values in composite::attention (same I/O)."""

    def __init__(self, attention: Attention):
        super().__init__()
        import composite.ops.attention  # noqa: F401  (defines torch.ops.composite.attention)

        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        self._project = attention._project

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        kv, hd = self.n_kv_heads, self.head_dim
        q, k, v = self._project(x, cos, sin)
        q = q.reshape(kv, self.n_heads // kv * t, hd) * (1.0 / math.sqrt(hd))
        k_new = k.reshape(kv, t, hd).transpose(1, 2)  # [kv, hd, t]
        v_new = v.reshape(kv, t, hd)
        out = torch.ops.composite.attention(q, k_cache, v_cache, k_new, v_new, mask)
        out = out.view(b, self.n_heads, t, hd).transpose(1, 2).reshape(b, t, self.n_heads * hd)
        return self.wo(out), k_new, v_new


def xnnpack_form(module: nn.Module, attention: str = "graph") -> nn.Module:
    """A copy of `module` with XNNPACK-friendly norms and, with attention "kernel", our attention
    operator; parameters are shared, not copied."""
    shared = [*module.parameters(), *module.buffers()]
    module = copy.deepcopy(module, memo={id(t): t for t in shared})
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, XnnpackRMSNorm(child))
            elif isinstance(child, FeedForward):
                setattr(parent, name, XnnpackFeedForward(child))
            elif isinstance(child, Attention) and attention == "kernel":
                setattr(parent, name, KernelAttention(child))
    return module


def half_form(form: nn.Module, has_head: bool) -> nn.Module:
    """An fp16 copy of an XNNPACK form with float16 native I/O and norms that cannot overflow (the
    caller's form keeps float32)."""
    inv_freq = form.inv_freq
    half = native_io.HalfIO(copy.deepcopy(form), has_head)
    half.shard.rope = HalfRope(inv_freq)
    for parent in list(half.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, XnnpackRMSNorm):
                setattr(parent, name, PeakScaledRMSNorm(child).half())
            elif isinstance(child, QuantizedEmbedding):
                child.output_dtype = torch.float16
    return half


def quantize_linears(
    module: torch.nn.Module,
    options: dict,
    in_place: bool = False,
    only: str | None = None,
    skipped: list[str] | None = None,
) -> tuple[torch.nn.Module, list[str]]:
    """A copy with 8-bit dynamically quantized activations and int4 (8da4w, grouped by group_size,
    0 = per channel) or int8 (8da8w, per channel) weights; the head (`output`) as head_quantize
    says; scales as weight_mapping says. The caller's module keeps its float weights, unless
    in_place (each float weight is then let go as its linear is quantized). only: quantize the
    linears under this module path alone (a streamed shard quantizes each layer as it is read);
    skipped: where to add the names of linears left in float (the caller then writes the note).
    options: an XNNPACK placement's (composite/config.py). -> (module, notes on what was skipped)."""
    if not in_place:
        module = copy.deepcopy(module)
    noted = skipped is None
    skipped = [] if skipped is None else skipped
    head = options["head_quantize"]
    head_scheme = options["quantize"] if head == "same" else head
    for fqn, linear in list(module.named_modules()):
        if not isinstance(linear, torch.nn.Linear) or linear.weight.is_meta:
            continue
        if only is not None and fqn != only and not fqn.startswith(only + "."):
            continue
        scheme = head_scheme if fqn == "output" else options["quantize"]
        if scheme == "none":
            continue
        quantized, group_size = torchao_weights.scheme_config(scheme, options["group_size"], options["weight_mapping"])
        if group_size and linear.in_features % group_size:
            skipped.append(fqn)
            continue
        torchao_weights.quantize_by_rows(linear, quantized)
    return module, fp32_note(skipped, options) if noted else []


def fp32_note(skipped: list[str], options: dict) -> list[str]:
    if not skipped:
        return []
    return [
        f"{len(skipped)} linears left in fp32 (in_features not a multiple of group size {options['group_size']}): "
        f"{', '.join(skipped)}"
    ]


def lower_xnnpack_shard(work: ShardWork, stages: dict[str, float]) -> BackendLowering:
    """An XNNPACK shard read and lowered. A quantized shard quantizes each unit as it is read (its
    float weights go before the next unit's come), and the embedding table as work says."""
    options = work.placement.options
    quantized = options["quantize"] != "none"
    notes: list[str] = []
    skipped: list[str] = []

    def quantize_unit(model, unit) -> None:
        if unit != "embedding":
            only = "output" if unit == "head" else f"layers.{unit}"
            quantize_linears(model, options, in_place=True, only=only, skipped=skipped)

    with timed(stages, "read+quantize"):
        module = load_shard(work, quantize_unit if quantized else None, notes)
    shared_head = work.shared_table is not None and work.spec.has_head
    with timed(stages, "lower"):
        edge, lowering_notes, encodings = lower_module(
            module, work.examples(), work.names(), options, quantized, shared_head
        )
        del module
    with timed(stages, "serialize"):
        lookup = shared_table.tag_lookup if work.shared_table is not None and work.spec.has_embedding else None
        shard = finish(
            edge, fp32_note(skipped, options) + lowering_notes + notes, external=lookup, data_file=work.data_file
        )
    return BackendLowering(shard, encodings)


def lower_module(
    module, example_inputs: dict, names: dict, options: dict, prequantized: bool = False, shared_head: bool = False
):
    """`module` (a shard) as XNNPACK's edge program. -> (EdgeProgramManager, notes, method -> ("in" | "out", name) -> Encoding of the native I/O
    that is not float32). names: method -> (input names, output names). prequantized: the module's
    linears are already quantized as options say (a copy is quantized otherwise). shared_head: the
    head's int8 weight is the tied table stored once, kept outside the .pte (lowering/shared_table.py).

    With attention "kernel", the one-token method (decode) calls composite::attention; wider
    methods (prefill) keep the graph's batched matmuls, which XNNPACK runs faster over many rows.
    Both forms hold the same (quantized) weights, which the program stores once."""
    notes = []
    if options.get("quantize", "none") != "none" and not prequantized:
        module, notes = quantize_linears(module, options)
    forms = {"graph": xnnpack_form(module, "graph")}
    if options.get("attention") == "kernel":
        forms["kernel"] = xnnpack_form(module, "kernel")
    encodings: dict[str, dict] = {method: {} for method in example_inputs}
    if options.get("dtype") == "fp16":
        has_head = next(iter(names.values()))[1][0] == "logits"
        forms = {name: half_form(form, has_head) for name, form in forms.items()}
        example_inputs, encodings = native_io.half_io(names, example_inputs)
    exported = {}
    for method, inputs in example_inputs.items():
        form = forms["kernel"] if "kernel" in forms and inputs[0].shape[1] == 1 else forms["graph"]
        exported.update(export_methods(form, {method: inputs}))
    # ExecuTorch's exir loads here, not on import: composite.tune quantizes with this module in eager PyTorch.
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    passes = [shared_table.tag_head] if shared_head else None
    edge = to_edge_transform_and_lower(exported, transform_passes=passes, partitioner=[XnnpackPartitioner()])
    return edge, notes, encodings
