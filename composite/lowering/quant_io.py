"""Quantized I/O for quantized QNN shards: hidden states and KV caches cross the graph boundary as
uint16 (16-bit activations) or uint8 (8-bit), not float32.

Three steps, in the order an export meets them:
1. After calibration, `share_ranges` gives every group of I/O observers that must agree one range,
   so convert_pt2e gives them one scale and zero point: a layer's cache input and its new-entry
   output in every method (the runner copies new entries into the cache as they are), and the
   hidden state between two adjacent QNN shards (passed from one to the next untouched).
2. After convert_pt2e, `read_params` reads each I/O tensor's dtype, scale and zero point from the
   quantize node after its placeholder or the dequantize node before the output; `tag_function`
   tells ExecuTorch's TagQuantIO pass which placeholders and outputs the QNN graph takes and gives
   quantized, so no conversion is compiled into it.
3. `QuantizedIoPlanning` writes those dtypes into the program's I/O tensors. ExecuTorch's own
   BuildQuantIo pass cannot: later passes re-trace the delegate's float graph with the new dtypes.

The runners convert only where a quantized tensor meets a float one (a QNN shard next to a CPU
shard), as composite/runtime/quantized.py says.
"""

from __future__ import annotations

import torch

from composite.runtime.quantized import QuantParams

# The I/O a quantized QNN shard takes and gives quantized, by name; positions, mask and logits stay
# as they are (int64, float32).
QUANTIZED_NAMES = ("hidden", "k_cache.", "v_cache.", "k_new.", "v_new.")
DTYPE_BY_QMAX = {255: torch.uint8, 65535: torch.uint16}


def is_quantized_name(name: str) -> bool:
    return name == "hidden" or name.startswith(QUANTIZED_NAMES[1:])


def _observer_node(node: torch.fx.Node) -> torch.fx.Node | None:
    return node if node.op == "call_module" and "activation_post_process" in str(node.target) else None


def io_observers(prepared: torch.fx.GraphModule, input_names: list[str], output_names: list[str]) -> dict:
    """("in" | "out", name) -> the observer module watching that quantized I/O tensor of a
    prepare_pt2e graph (inputs by placeholder order, outputs by position)."""
    found = {}
    placeholders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
    for name, node in zip(input_names, placeholders):
        if not is_quantized_name(name):
            continue
        observers = [u for u in node.users if _observer_node(u)]
        if observers:
            found[("in", name)] = prepared.get_submodule(observers[0].target)
    output = next(n for n in prepared.graph.nodes if n.op == "output")
    for name, node in zip(output_names, output.args[0]):
        if is_quantized_name(name) and _observer_node(node):
            found[("out", name)] = prepared.get_submodule(node.target)
    return found


def share_ranges(groups: list[list]) -> None:
    """Each group of observers gets the union of its members' ranges, hence one scale and zero
    point after convert_pt2e. Observers of different widths are left alone (the runner converts
    between them)."""
    for group in groups:
        widths = {(o.quant_min, o.quant_max) for o in group}
        if len(group) < 2 or len(widths) != 1 or not all(hasattr(o, "min_val") for o in group):
            continue
        low = min(float(o.min_val) for o in group)
        high = max(float(o.max_val) for o in group)
        for observer in group:
            observer.min_val.fill_(low)
            observer.max_val.fill_(high)


def read_params(converted: torch.fx.GraphModule, input_names: list[str], output_names: list[str]) -> dict:
    """("in" | "out", name) -> QuantParams of each quantized I/O tensor of a convert_pt2e graph."""
    params = {}

    def from_node(node: torch.fx.Node) -> QuantParams | None:
        if "quantize_per_tensor" not in str(node.target):
            return None
        _, scale, zero_point, _, quant_max, *_ = node.args
        dtype = DTYPE_BY_QMAX.get(int(quant_max))
        return None if dtype is None else QuantParams(dtype, float(scale), int(zero_point))

    placeholders = [n for n in converted.graph.nodes if n.op == "placeholder"]
    for name, node in zip(input_names, placeholders):
        if is_quantized_name(name):
            found = [p for u in node.users if (p := from_node(u)) is not None]
            if found:
                params[("in", name)] = found[0]
    output = next(n for n in converted.graph.nodes if n.op == "output")
    for name, node in zip(output_names, output.args[0]):
        if is_quantized_name(name) and (p := from_node(node)) is not None:
            params[("out", name)] = p
    return params


def tag_function(user_inputs: list[str], input_dtypes: dict[int, torch.dtype], output_dtypes: dict[int, torch.dtype]):
    """TagQuantIO's get_quant_io_dtype_fn: placeholders by their user-input position, outputs by
    their position in the graph's output."""
    by_name = {user_inputs[i]: dtype for i, dtype in input_dtypes.items()}

    def dtype_of(node: torch.fx.Node):
        if node.op == "placeholder":
            return by_name.get(node.name)
        for user in node.users:
            if user.op == "output":
                position = list(user.args[0]).index(node)
                return output_dtypes.get(position)
        return None

    return dtype_of


def planning_pass(input_dtypes: dict[int, torch.dtype], output_dtypes: dict[int, torch.dtype]):
    """The memory-planning pass of one method, which first gives its quantized I/O their dtypes."""
    from executorch.exir.passes import MemoryPlanningPass

    class QuantizedIoPlanning(MemoryPlanningPass):
        def run(self, graph_module, graph_signature=None):
            names = list(graph_signature.user_inputs)
            placeholders = {n.name: n for n in graph_module.graph.nodes if n.op == "placeholder"}
            for position, dtype in input_dtypes.items():
                placeholders[names[position]].meta["spec"].scalar_type = dtype
            output = next(n for n in graph_module.graph.nodes if n.op == "output")
            for position, dtype in output_dtypes.items():
                output.args[0][position].meta["spec"].scalar_type = dtype
            return super().run(graph_module, graph_signature)

    return QuantizedIoPlanning(alloc_graph_input=False)
