"""Native I/O for QNN shards: hidden states and KV caches cross the graph boundary in the shard's
own activation dtype, not float32: float16 for fp16 shards, uint16 for 16-bit activations, uint8
for 8-bit. The mask, positions and logits stay as they are.

fp16: `HalfIO` runs the HTP form in float16 and takes the float32 mask, casting it in the graph;
a head's logits are cast back to float32.

Quantized precisions, three steps, in the order an export meets them:
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

The runners convert only where one encoding meets another (a QNN shard next to a CPU shard), as
composite/runtime/encoding.py says.
"""

from __future__ import annotations

import torch

from composite.runtime.encoding import Encoding

# The I/O a QNN shard takes and gives in its own dtype, by name; positions, mask and logits stay as
# they are (int64, float32).
NATIVE_NAMES = ("hidden", "k_cache.", "v_cache.", "k_new.", "v_new.")
DTYPE_BY_QMAX = {255: torch.uint8, 65535: torch.uint16}


def is_native_name(name: str) -> bool:
    return name == "hidden" or name.startswith(NATIVE_NAMES[1:])


class HalfIO(torch.nn.Module):
    """A shard in float16 that takes the runner's float32 mask and gives float32 logits."""

    def __init__(self, shard: torch.nn.Module, has_head: bool):
        super().__init__()
        self.shard, self.has_head = shard.half(), has_head

    def forward(self, x, *inputs):
        inputs = [t.to(torch.float16) if t.dtype == torch.float32 else t for t in inputs]  # the mask
        outputs = self.shard(x, *inputs)
        return (outputs[0].float(), *outputs[1:]) if self.has_head else outputs


def half_io(names: dict, example_inputs: dict) -> tuple[dict, dict]:
    """A HalfIO shard's example inputs (its native inputs in float16) and the encodings of its
    native I/O, method -> ("in" | "out", name) -> float16. names: method -> (inputs, outputs)."""
    half = Encoding(torch.float16)
    examples, encodings = {}, {}
    for method, (inputs, outputs) in names.items():
        examples[method] = tuple(t.half() if is_native_name(n) else t for n, t in zip(inputs, example_inputs[method]))
        encodings[method] = {
            (side, n): half for side, ns in (("in", inputs), ("out", outputs)) for n in ns if is_native_name(n)
        }
    return examples, encodings


def _observer_node(node: torch.fx.Node) -> torch.fx.Node | None:
    return node if node.op == "call_module" and "activation_post_process" in str(node.target) else None


def io_observers(prepared: torch.fx.GraphModule, input_names: list[str], output_names: list[str]) -> dict:
    """("in" | "out", name) -> the observer module watching that quantized I/O tensor of a
    prepare_pt2e graph (inputs by placeholder order, outputs by position)."""
    found = {}
    placeholders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
    for name, node in zip(input_names, placeholders):
        if not is_native_name(name):
            continue
        observers = [u for u in node.users if _observer_node(u)]
        if observers:
            found[("in", name)] = prepared.get_submodule(observers[0].target)
    output = next(n for n in prepared.graph.nodes if n.op == "output")
    for name, node in zip(output_names, output.args[0]):
        if is_native_name(name) and _observer_node(node):
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
    """("in" | "out", name) -> Encoding of each quantized I/O tensor of a convert_pt2e graph."""
    params = {}

    def from_node(node: torch.fx.Node) -> Encoding | None:
        if "quantize_per_tensor" not in str(node.target):
            return None
        _, scale, zero_point, _, quant_max, *_ = node.args
        dtype = DTYPE_BY_QMAX.get(int(quant_max))
        return None if dtype is None else Encoding(dtype, float(scale), int(zero_point))

    placeholders = [n for n in converted.graph.nodes if n.op == "placeholder"]
    for name, node in zip(input_names, placeholders):
        if is_native_name(name):
            found = [p for u in node.users if (p := from_node(u)) is not None]
            if found:
                params[("in", name)] = found[0]
    output = next(n for n in converted.graph.nodes if n.op == "output")
    for name, node in zip(output_names, output.args[0]):
        if is_native_name(name) and (p := from_node(node)) is not None:
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
