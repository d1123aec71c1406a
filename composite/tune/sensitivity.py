"""What a choice costs in quality: the KL divergence of the model's next-token distributions, with
one group changed (or several, for a whole recipe), against the float model, on a text, in PyTorch.

The text is cut and scored as composite.eval cuts and scores it (composite/eval/scoring.py), and
the KLD is llama.cpp's (composite/eval/metrics.py). The float model runs each chunk once; the hidden
state entering every group is kept, so a changed group's evaluation starts there.

How each choice runs:
- xnnpack:8da8w / 8da4w: the group's layers (or the head) quantized by the export's own
  quantize_linears (torchao: int8 per-token activations, int8 or int4 weights), in eager PyTorch.
  Per-token activation quantization makes a whole chunk at once the same as token by token.
- qnn:16a8w / 16a4w / 8a8w: the graph the export builds for the shard (HTP form, QNN quantizer,
  min/max observers), calibrated by the export's own calibration (the float chain fed the export's
  calibration text), converted to its fake-quantized form (torchao's convert_pt2e), and called with
  a KV cache of its own as a runner calls it. A layer group runs its prefill method's graph (calls
  of prefill_len positions: ~30x fewer calls than one per token, and the same quantizer on inputs
  of the same kind); the head a graph of its decode step's form on prefill_len rows at once
  (logits on every row: with per-tensor observers its ranges are those of the decode graph fed
  the same rows, and each row's result is the decode graph's), calibrated on the rows of prefill
  calls over the export's decode tokens (calibrate(head_decode_from_rows=True)). The HTP's own integer
  kernels are not simulated: this is the quantizer's arithmetic, not the NPU's.
- qnn:fp16: the same graphs' HTP form in float16 (norms accumulate in float32 as QNN's RmsNorm
  does): an approximation of the HTP's fp16.
- the embedding: the export's quantized table (composite/lowering/embedding.py).
- xnnpack:fp32 is the float model: KLD 0.
"""

from __future__ import annotations

import json
import time

import torch
from torch import nn

from composite.config import Placement
from composite.eval.scoring import chunks as cut_chunks
from composite.eval.scoring import eval_tokens, first_scored
from composite.lowering.calibration import calibrate, effective_options
from composite.lowering.embedding import QuantizedEmbedding
from composite.lowering.qnn.htp_graph import htp_form
from composite.lowering.xnnpack import quantize_linears
from composite.manifest import DECODE, MASK_HIDDEN, PREFILL, method_widths
from composite.model.llama import cache_shapes, rope_cos_sin
from composite.placement_options import DEFAULT_OPTIONS
from composite.runtime.kv_cache import AttentionMask, KVCache
from composite.runtime.shard_call import call_inputs, write_new_entries
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule, shard_io
from composite.tune.candidates import Candidate, Group


class Layers(nn.Module):
    """A run of the model's decoder layers, as quantize_linears takes them (module paths
    "layers.N...", the same as in the checkpoint)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h, cos, sin):
        for layer in self.layers:
            h = layer.forward_full(h, cos, sin)
        return h


class Head(nn.Module):
    def __init__(self, norm, output):
        super().__init__()
        self.norm, self.output = norm, output

    def forward(self, h):
        return self.output(self.norm(h))


def fake_quant(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    """quantize_per_tensor then dequantize_per_tensor (torch.ao's quantized_decomposed ops), the
    same float32 arithmetic to the bit, in one new tensor and three in-place passes over it
    (faster than ATen's fake_quantize_per_tensor_affine, which also builds a gradient mask)."""
    y = torch.mul(x, 1.0 / scale)
    y.round_()
    y.clamp_(quant_min - zero_point, quant_max - zero_point)  # = clamp(q + zp, min, max) - zp: integers
    return y.mul_(scale)


def pointwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A 1x1 convolution (a linear in the HTP form's NCHW layout) as one matrix product: ATen's CPU
    conv2d takes its slow path at these shapes."""
    b, c, h, w = x.shape
    out = torch.matmul(weight.view(weight.shape[0], c), x.reshape(b, c, h * w)).view(b, -1, h, w)
    return out if bias is None else out + bias.view(1, -1, 1, 1)


# Ops whose output holds only values of their input(s): on a quantization grid if those are.
_SAME_VALUES = {
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.cat.default,
}


def _is_pointwise(graph: torch.fx.GraphModule, conv: torch.fx.Node) -> bool:
    """conv2d(x, weight, bias, stride, padding, dilation, groups) with a constant 1x1 kernel and
    nothing else."""
    weight = conv.args[1]
    shape = (
        getattr(graph, weight.target).shape if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" else None
    )
    defaults = ([1, 1], [0, 0], [1, 1], 1)
    settings = [list(a) if isinstance(a, (list, tuple)) else a for a in conv.args[3:]]
    settings += list(defaults[len(settings) :])
    return shape is not None and tuple(shape[2:]) == (1, 1) and settings == [*defaults] and not conv.kwargs


def faster_fake_quant(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The converted (fake-quantized) graph with the same arithmetic in fewer and faster ops, for
    the tuner's many calls of it; to the bit but for the 1x1 convolutions' summation order, which
    now and then puts a value on the other side of a rounding step (docs/tune.md):
    - every quantize_per_tensor and its dequantize_per_tensor nodes (one per consumer) as one
      fake_quant (above);
    - a fake_quant of values already on its grid (its input a reshape, slice, cat, ... of values
      fake-quantized with the same scale, zero point and range: QNN's quantizer gives such ops
      their input's encoding) dropped: rounding a grid value to its grid gives it back;
    - every weight's dequantization (per channel, or per block: dequantize_affine) computed once
      (the weights are constants);
    - 1x1 convolutions as matrix products (pointwise_conv)."""
    ops = torch.ops.quantized_decomposed
    nodes = graph.graph
    grid: dict[torch.fx.Node, tuple] = {}  # node -> the quantization grid all its values lie on

    def grid_of(value):
        if isinstance(value, (list, tuple)):
            grids = {grid_of(v) for v in value}
            return grids.pop() if len(grids) == 1 else None
        return grid.get(value) if isinstance(value, torch.fx.Node) else None

    for node in list(nodes.nodes):
        if node.op != "call_function":
            continue
        if node.target in (ops.dequantize_per_channel.default, torch.ops.torchao.dequantize_affine.default) and all(
            a.op == "get_attr" for a in node.args if isinstance(a, torch.fx.Node)
        ):
            values = [getattr(graph, a.target) if isinstance(a, torch.fx.Node) else a for a in node.args]
            name = f"_dequantized_{node.name}"
            graph.register_buffer(name, node.target(*values, **node.kwargs))
            with nodes.inserting_before(node):
                constant = nodes.get_attr(name)
            node.replace_all_uses_with(constant)
            nodes.erase_node(node)
        elif node.target == ops.quantize_per_tensor.default and not node.kwargs:
            # one fake_quant for the quantize node and all its dequantize nodes (one per consumer)
            x, scale, zero_point, quant_min, quant_max, _ = node.args
            users = list(node.users)
            if not users or any(
                u.target != ops.dequantize_per_tensor.default or u.kwargs or tuple(u.args[1:]) != tuple(node.args[1:])
                for u in users
            ):
                continue
            encoding = (scale, zero_point, quant_min, quant_max)
            if grid_of(x) == encoding:
                replacement = x
            else:
                with nodes.inserting_after(node):
                    replacement = nodes.call_function(fake_quant, (x, *encoding))
                grid[replacement] = encoding
            for user in users:
                user.replace_all_uses_with(replacement)
                nodes.erase_node(user)
        elif node.target == torch.ops.aten.conv2d.default and _is_pointwise(graph, node):
            node.target = pointwise_conv
            node.args = node.args[:3]
        elif node.target in _SAME_VALUES:
            values = node.args[0] if node.target == torch.ops.aten.cat.default else node.args[:1]
            encoding = grid_of(list(values))
            if encoding is not None:
                grid[node] = encoding
    nodes.eliminate_dead_code()
    graph.recompile()
    return graph


class CallByCall:
    """A shard's graph called as a runner calls it, `width` positions per call with a KV cache of
    its own layers: maps the hidden states of a whole chunk [1, T, dim] to its outputs [1, T, ...].
    A head's graph (no layers) gets the index of every row, whose logits it gives."""

    def __init__(self, graph, n_layers: int, width: int, cache_shapes: tuple, max_seq_len: int, dtype=torch.float32):
        self.graph, self.n_layers, self.width = graph, n_layers, width
        self.shapes, self.max_seq_len, self.dtype = cache_shapes, max_seq_len, dtype

    def __call__(self, h, cos=None, sin=None):
        cache = KVCache(self.n_layers, *self.shapes)
        mask = AttentionMask(self.width, self.max_seq_len, MASK_HIDDEN)
        outputs = []
        with torch.no_grad():
            for pos in range(0, h.shape[1], self.width):
                count = min(self.width, h.shape[1] - pos)
                x = torch.zeros((1, self.width, h.shape[2]), dtype=self.dtype)
                x[:, :count] = h[:, pos : pos + count]
                caches = [(k.to(self.dtype), v.to(self.dtype)) for k, v in zip(cache.k, cache.v)]
                rows = None if self.n_layers else torch.arange(self.width)  # every row's logits
                out = self.graph(*call_inputs(x, pos, self.width, mask.at(pos).to(self.dtype), caches, rows))
                write_new_entries(cache, range(self.n_layers), [out[0], *(t.float() for t in out[1:])], pos, count)
                outputs.append(out[0][:, :count].float())
        return torch.cat(outputs, dim=1)


class Sensitivity:
    """The float model's pass over the text, and evaluations of recipes against it."""

    def __init__(
        self,
        *,
        model,
        groups: list[Group],
        tokenizer,
        bos_id: int | None,
        text: str,
        ctx: int,
        limit_tokens: int | None,
        score: str,
        max_seq_len: int,
        prefill_len: int,
        group_size: int,
        soc: str,
        qnn_options: dict | None = None,
    ):
        """qnn_options: QNN placement options for every QNN candidate (block_size, rounding, ...),
        over the export's defaults."""
        self.model, self.groups, self.tokenizer, self.bos_id = model, groups, tokenizer, bos_id
        self.max_seq_len, self.prefill_len, self.group_size, self.soc = max_seq_len, prefill_len, group_size, soc
        self.qnn_options = dict(qnn_options or {})
        self.chunks = cut_chunks(eval_tokens(tokenizer, text, limit_tokens), ctx, bos_id)
        self.first = first_scored(ctx, score)
        args = model.args
        counts = [g.layer_end - g.layer_start for g in groups]
        self.specs = plan_shards(args, len(groups), counts)
        self.modules = [ShardModule(model, spec).eval() for spec in self.specs]
        self.cos, self.sin = rope_cos_sin(model.inv_freq, torch.arange(ctx))
        self.forms: dict[tuple[int, str], object] = {}
        # Per chunk: the hidden state entering each layer group (and the final one, before the
        # head's norm), and the float model's log-probabilities on the scored rows.
        self.boundaries: list[dict[int, torch.Tensor]] = []
        self.reference: list[torch.Tensor] = []
        starts = {g.layer_start for g in groups if g.kind == "layers"} | {args.n_layers}
        with torch.no_grad():
            for chunk in self.chunks:
                h = model.tok_embeddings(torch.tensor([chunk]))
                saved = {}
                for i, layer in enumerate(model.layers):
                    if i in starts:
                        saved[i] = h
                    h = layer.forward_full(h, self.cos, self.sin)
                saved[args.n_layers] = h
                self.boundaries.append(saved)
                self.reference.append(self._scored_logp(model.output(model.norm(h))).float())

    @property
    def scored_tokens(self) -> int:
        return len(self.chunks) * (len(self.chunks[0]) - self.first)

    def _scored_logp(self, logits: torch.Tensor) -> torch.Tensor:
        """log-probabilities (float64) of the rows that predict the scored tokens."""
        return torch.log_softmax(logits[0, self.first - 1 : -1].double(), dim=-1)

    # The forms of each choice

    def form(self, group: Group, choice):
        key = (group.index, choice if isinstance(choice, str) else choice.name)
        if key not in self.forms:
            if isinstance(choice, Candidate) and choice.quantized_qnn:
                self.prepare_qnn([(group, choice)])
            else:
                self.forms[key] = self._build(group, choice)
        return self.forms[key]

    def _build(self, group: Group, choice):
        model = self.model
        if group.kind == "embedding":
            bits, group_size = (int(v) for v in choice.split(","))
            return QuantizedEmbedding(model.tok_embeddings.weight, bits, group_size)
        layers = [model.layers[i] for i in range(group.layer_start, group.layer_end)]
        if choice.backend == "xnnpack":
            base = Head(model.norm, model.output) if group.kind == "head" else Layers(layers)
            options = {
                **DEFAULT_OPTIONS["xnnpack"],
                "quantize": choice.precision,
                "group_size": self.group_size,
                "head_quantize": "same",
            }
            return quantize_linears(base, options)[0].eval()
        # qnn:fp16
        half = htp_form(self.modules[group.index], self._positions(), linear_as_conv=False).half().eval()
        return self._call_by_call(group, half, torch.float16)

    def _positions(self) -> int:
        return self.max_seq_len + self.prefill_len

    def _method(self, group: Group) -> str:
        """The method whose graph stands for a QNN group: a layer group's prefill (a chunk in calls
        of prefill_len positions), the head's decode (its prefill method gives one row of logits;
        here it is built on prefill_len rows, each with its logits)."""
        return DECODE if group.kind == "head" else PREFILL

    def _call_by_call(self, group: Group, graph, dtype=torch.float32) -> CallByCall:
        n_layers = group.layer_end - group.layer_start
        shapes = cache_shapes(self.model.args, self.max_seq_len)
        return CallByCall(graph, n_layers, self.prefill_len, shapes, self.max_seq_len, dtype)

    def prepare_qnn(self, pairs: list[tuple[Group, Candidate]]) -> None:
        """Builds, calibrates (one pass of the float chain for all of them with the same calibration
        settings as the export's: calibration.effective_options) and converts the quantized QNN
        graphs of `pairs` not built yet."""
        pairs = [(g, c) for g, c in pairs if (g.index, c.name) not in self.forms]
        by_settings: dict[str, list] = {}
        for group, candidate in pairs:
            options = self._options(candidate)
            settings = effective_options([Placement("qnn", options)], 0)
            by_settings.setdefault(json.dumps(settings, sort_keys=True), []).append((group, candidate))
        for settings, chosen in by_settings.items():
            self._prepare_qnn(chosen, json.loads(settings))

    def _options(self, candidate: Candidate) -> dict:
        return {
            **DEFAULT_OPTIONS["qnn"],
            **self.qnn_options,
            "soc": self.soc,
            "precision": candidate.precision,
            "weight_sharing": False,
        }

    def _prepare_qnn(self, pairs: list[tuple[Group, Candidate]], calibration: dict) -> None:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        from composite.lowering.qnn.shard import QnnShardLowering, traced_htp

        jobs: dict[int, list] = {}
        traces: dict[int, dict] = {}  # one torch.export per group, whatever its precisions
        for group, candidate in pairs:
            spec = self.specs[group.index]
            method = self._method(group)
            inputs, outputs = shard_io(self.model.args, spec, self.prefill_len, self.max_seq_len)
            example = [t.example() for t in inputs]
            if group.kind == "head":  # every row's logits (see _method)
                example[-1] = torch.arange(self.prefill_len)
            examples = {method: tuple(example)}
            names = {method: ([t.name for t in inputs], [t.name for t in outputs])}
            options = self._options(candidate)
            module = self.modules[group.index]
            if group.index not in traces:
                traces[group.index] = traced_htp(module, examples, options, self._positions())
            job = QnnShardLowering(module, examples, names, options, self._positions(), traces[group.index])
            jobs.setdefault(group.index, []).append((group, candidate, job))

        def consumer(index):
            def observe(method, inputs):
                for group, _, job in jobs[index]:
                    if method == self._method(group):
                        job.observe(method, inputs)

            return observe

        traces.clear()
        methods = method_widths(self.prefill_len)
        consumers = {index: consumer(index) for index in jobs}
        calibrate(
            self.model,
            self.modules,
            consumers,
            methods,
            self.max_seq_len,
            calibration,
            self.tokenizer,
            self.bos_id,
            head_decode_from_rows=True,
        )
        for entries in jobs.values():
            for group, candidate, job in entries:
                job.round_weights()
                graph = faster_fake_quant(convert_pt2e(job.graphs[self._method(group)]))
                self.forms[(group.index, candidate.name)] = self._call_by_call(group, graph)

    # Evaluation

    def logits(self, chunk_index: int, recipe: dict[int, object]) -> torch.Tensor:
        """The model's logits [1, T, vocab] on one chunk with the groups in `recipe` (group index ->
        choice) changed and the rest float."""
        changed = sorted(recipe)
        model, saved = self.model, self.boundaries[chunk_index]
        first = self.groups[changed[0]]
        if first.kind == "embedding":
            h = self.form(first, recipe[first.index])(torch.tensor([self.chunks[chunk_index]]))
            start = 0
        elif first.kind == "layers":
            h, start = saved[first.layer_start], first.layer_start
        else:
            h, start = saved[model.args.n_layers], model.args.n_layers
        with torch.no_grad():
            for group in self.groups:
                if group.kind != "layers" or group.layer_start < start:
                    continue
                if group.index in recipe:
                    h = self.form(group, recipe[group.index])(h, self.cos, self.sin)
                else:
                    for i in range(group.layer_start, group.layer_end):
                        h = model.layers[i].forward_full(h, self.cos, self.sin)
            head = self.groups[-1]
            if head.index in recipe:
                return self.form(head, recipe[head.index])(h)
            return model.output(model.norm(h))

    def evaluate(self, recipe: dict[int, object], chunk_count: int | None = None) -> dict:
        """Mean KLD against the float model and top-1 agreement over the scored tokens (of the
        first `chunk_count` chunks: what composite.eval scores with a smaller --limit-tokens)."""
        recipe = {i: c for i, c in recipe.items() if not (isinstance(c, Candidate) and c.is_float) and c != "none"}
        if not recipe:
            return {"kld": 0.0, "top1": 1.0, "seconds": 0.0}
        started = time.perf_counter()
        total, same, count = 0.0, 0, 0
        for i, reference in enumerate(self.reference[:chunk_count]):
            logq = self._scored_logp(self.logits(i, recipe))
            logp = reference.double()
            total += float((logp.exp() * (logp - logq)).sum())
            same += int((logp.argmax(-1) == logq.argmax(-1)).sum())
            count += logp.shape[0]
        return {"kld": total / count, "top1": same / count, "seconds": round(time.perf_counter() - started, 2)}

    def release(self, group: Group, choice) -> None:
        """Drop a built form (they hold copies of weights)."""
        self.forms.pop((group.index, choice if isinstance(choice, str) else choice.name), None)
