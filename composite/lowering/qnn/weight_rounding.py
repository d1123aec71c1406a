"""4-bit weights of a quantized QNN shard rounded by what the layer computes, not weight by weight.

Nearest rounding makes each weight's own error as small as it can be; the output of a linear sums
those errors over its inputs, weighted by the inputs it meets. GPTQ (Frantar et al., 2022) rounds
a weight's input channels one after another and moves each one's error onto the channels not yet
rounded, as the inputs' second moments H = sum x x^T say, which makes the output's squared error
smaller for those inputs. Here the scales stay those the weight observers chose (LPBQ's grid,
lpbq.py, or 16a4w's per channel), and the weights are replaced by values on that grid, so that
converting the graph gives exactly those integers; the HTP computes with them as it would with
any others.

H comes from the calibration run: each 1x1 convolution (a linear in the HTP form) of the prepared
graphs sums x x^T of its input over every calibration call of every method. A weight both
methods read (a shard's decode and prefill graphs share their weights) is rounded once, with both
methods' inputs.
"""

from __future__ import annotations

from collections import Counter

import torch

DAMPING = 0.01  # of H's mean diagonal, added to its diagonal (GPTQ's choice): keeps H invertible
COLUMNS_AT_ONCE = 128  # GPTQ's lazy batch: columns whose updates are applied together
ROWS_AT_ONCE = 512  # calibration rows gathered before they are added to an input's moments
# Ops between a tensor and a convolution that reads it which leave its rows and channels as they
# are: convolutions behind them read the same inputs, and share one sum of their moments.
SAME_ROWS = {
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
}


def moment_bytes(args, n_layers: int) -> int:
    """float32 bytes of the input moments a calibration keeps for `n_layers` decoder layers: one
    [width, width] sum per distinct input of their linears (q/k/v's, o's, w1/w3's, w2's)."""
    widths = (args.dim, args.n_heads * args.head_dim, args.dim, args.hidden_dim)
    return 4 * n_layers * sum(w * w for w in widths)


def gptq(
    weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, qmax: int, by_importance: bool = True
) -> torch.Tensor:
    """`weight` [out, in] rounded onto the symmetric grid of `scales` [out, in] (each weight's own
    scale) in [-qmax, qmax], input channel by input channel, each channel's error moved onto the
    channels after it as `hessian` [in, in] says. by_importance: the channels with the largest
    inputs first (GPTQ's "act order"; the scales are fixed, so the order changes only the
    rounding). -> the rounded weights as floats (on the grid)."""
    order = torch.argsort(hessian.diagonal(), descending=True) if by_importance else torch.arange(weight.shape[1])
    w = weight.detach().float()[:, order].clone()
    scales = scales.float()[:, order]
    h = hessian.float()[order][:, order]
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(DAMPING * h.diagonal().mean())
    # H^-1's upper Cholesky factor, one [in, in] matrix at a time alive (an 8192-wide input: 268 MB each)
    h = torch.linalg.cholesky(h)
    h = torch.cholesky_inverse(h)
    inverse = torch.linalg.cholesky(h, upper=True)
    del h
    rounded = torch.zeros_like(w)
    columns = w.shape[1]
    for first in range(0, columns, COLUMNS_AT_ONCE):
        last = min(first + COLUMNS_AT_ONCE, columns)
        block, errors = w[:, first:last].clone(), torch.zeros(w.shape[0], last - first, dtype=w.dtype)
        local = inverse[first:last, first:last]
        for i in range(last - first):
            column, scale = block[:, i], scales[:, first + i]
            q = (column / scale).round().clamp(-qmax, qmax) * scale
            rounded[:, first + i] = q
            error = (column - q) / local[i, i]
            block[:, i:] -= error.unsqueeze(1) * local[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, last:] -= errors @ inverse[first:last, last:]
    return rounded[:, torch.argsort(order)].to(weight.dtype)


class InputMoments:
    """sum x x^T over the rows of a 1x1 convolution's input (x: [batch, channels, h, w]). Rows are
    gathered and added a block at a time: a decode call's one row as an outer product would read
    the whole sum each call."""

    def __init__(self, channels: int):
        self.sum = torch.zeros(channels, channels)
        self.rows: list[torch.Tensor] = []
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        self.rows.append(x.detach().movedim(1, -1).reshape(-1, x.shape[1]).float())
        self.count += self.rows[-1].shape[0]
        if self.count >= ROWS_AT_ONCE:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            rows = torch.cat(self.rows)
            self.sum.addmm_(rows.T, rows)
            self.rows, self.count = [], 0


class Recorded:
    """A prepared graph's 1x1 convolution that also adds its input to `moments` (while calibrating)."""

    def __init__(self, moments: InputMoments):
        self.moments = moments
        self.__name__ = "recorded_conv2d"

    def __call__(self, x, *args):
        self.moments.add(x)
        return torch.ops.aten.conv2d.default(x, *args)


def pointwise_convolutions(graph: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, str, torch.nn.Module]]:
    """(convolution node, weight's get_attr target, weight observer) of each prepared 1x1
    convolution whose weight is observed."""
    found = []
    for node in graph.graph.nodes:
        convolution = node.target == torch.ops.aten.conv2d.default or isinstance(node.target, Recorded)
        if node.op != "call_function" or not convolution:
            continue
        weight = node.args[1]
        if weight.op != "call_module" or weight.args[0].op != "get_attr":
            continue
        parameter = weight.args[0].target
        if tuple(graph.get_parameter(parameter).shape[2:]) == (1, 1):
            found.append((node, parameter, graph.get_submodule(weight.target)))
    return found


def source(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose values a convolution's input is, behind reshapes and observers."""
    while (node.op == "call_module" or node.target in SAME_ROWS) and node.args:
        node = node.args[0]
    return node


def input_keys(graph: torch.fx.GraphModule) -> dict[str, frozenset]:
    """Each 1x1 convolution's node name -> the key of its input: the weights of every convolution
    that reads the same values (behind reshapes and observers). The same in every method's graph,
    whose convolutions read the same weights."""
    readers: dict[str, set] = {}
    sources = {}
    for conv, parameter, _ in pointwise_convolutions(graph):
        sources[conv.name] = source(conv.args[0]).name
        readers.setdefault(sources[conv.name], set()).add(parameter)
    return {name: frozenset(readers[src]) for name, src in sources.items()}


def watch_inputs(graphs: dict) -> dict[frozenset, InputMoments]:
    """Each 1x1 convolution of `graphs` (method -> prepared graph) made to add its input to the
    InputMoments of that input, which the convolutions reading it share, in every method (their
    inputs' key: input_keys). stop_watching puts the convolutions back."""
    moments: dict[frozenset, InputMoments] = {}
    for graph in graphs.values():
        keys, recorded = input_keys(graph), set()
        for conv, parameter, _ in pointwise_convolutions(graph):
            key = keys[conv.name]
            if key not in moments:
                moments[key] = InputMoments(graph.get_parameter(parameter).shape[1])
            # the first convolution of a source records it; the others read the same values
            conv.target = Recorded(moments[key]) if key not in recorded else torch.ops.aten.conv2d.default
            recorded.add(key)
        graph.recompile()
    return moments


def stop_watching(graphs: dict, moments: dict[frozenset, InputMoments]) -> None:
    for m in moments.values():
        m.flush()
    for graph in graphs.values():
        for conv, _, _ in pointwise_convolutions(graph):
            conv.target = torch.ops.aten.conv2d.default
        graph.recompile()


def round_weights(graphs: dict, moments: dict[frozenset, InputMoments]) -> int:
    """Each block-wise 4-bit weight of `graphs` (method -> calibrated prepared graph) replaced by
    its GPTQ rounding on the grid its observer chose, once per weight tensor, with the inputs of
    every method that reads it. -> how many weights were rounded. (16a4w's per-channel weights keep
    nearest rounding: GPTQ raised their KL divergence, docs/quality.md.)"""
    from composite.lowering.qnn.lpbq import LpbqObserver

    readers: dict[int, list] = {}  # a weight tensor -> (graph, parameter, input moments, weight observer) of each use
    for graph in graphs.values():
        keys = input_keys(graph)
        for conv, parameter, observer in pointwise_convolutions(graph):
            if not isinstance(observer, LpbqObserver):
                continue
            tensor = graph.get_parameter(parameter)
            inputs = moments[keys[conv.name]]
            readers.setdefault(id(tensor), []).append((graph, parameter, inputs, observer))
    pending = Counter(id(m) for uses in readers.values() for _, _, m, _ in uses)  # weights left to round, per input
    for uses in readers.values():
        graph, parameter, _, observer = uses[0]
        weight = graph.get_parameter(parameter)
        inputs = list({id(m): m for _, _, m, _ in uses}.values())
        hessian = inputs[0].sum if len(inputs) == 1 else sum(m.sum for m in inputs)
        scales = weight_scales(observer, weight)
        rounded = gptq(weight.reshape(weight.shape[0], -1), hessian, scales, 7).reshape(weight.shape)
        new = torch.nn.Parameter(rounded, requires_grad=False)
        for graph, parameter, _, _ in uses:
            owner, _, name = parameter.rpartition(".")
            setattr(graph.get_submodule(owner), name, new)
        del weight, hessian
        for _, _, m, _ in uses:  # an input's moments go with the last weight that reads it
            pending[id(m)] -= 1
            if pending[id(m)] == 0:
                m.sum = None
    return len(readers)


def weight_scales(observer, weight: torch.Tensor) -> torch.Tensor:
    """[out, in] the scale of each weight as the observer has chosen it (per block or per channel)."""
    scale, _ = observer.calculate_qparams()
    out, width = weight.shape[0], weight.shape[1]
    scale = scale.reshape(out, -1)
    return scale.repeat_interleave(width // scale.shape[1], dim=1)
