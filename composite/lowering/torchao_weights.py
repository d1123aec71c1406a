"""Linear weights quantized by torchao for XNNPACK: 8-bit dynamically quantized activations with
int4 (8da4w, in groups) or int8 (8da8w, per channel) weights, a block of rows at a time. The
XNNPACK lowering quantizes its shards' linears with it, and the shared tied table
(shared_table.py) its lookup, so that both are the same call on the same matrix."""

from __future__ import annotations

import torch

# quantize -> (torchao weight dtype, per-channel weights whatever the group size)
WEIGHT_SCHEMES = {"8da4w": (torch.int4, False), "8da8w": (torch.int8, True)}


def scheme_config(scheme: str, group_size: int, weight_mapping: str):
    """(torchao's config for `scheme`, the group size it uses: 0 = per channel)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    weight_dtype, per_channel = WEIGHT_SCHEMES[scheme]
    group_size = 0 if per_channel else group_size
    granularity = PerAxis(0) if group_size == 0 else PerGroup(group_size)
    quantized = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=weight_dtype,
        weight_granularity=granularity,
        weight_mapping_type=MappingType[weight_mapping.upper()],
    )
    return quantized, group_size


# A linear whose float weight is larger is quantized a block of rows at a time (Llama 3.2's tied
# 128256-row head: 1-1.6 GB of float32, which torchao's quantize_ would hold three times over).
ROW_BLOCK_BYTES = 64 << 20


def quantize_by_rows(linear: torch.nn.Linear, config) -> None:
    """torchao's quantize_ of one linear, a block of output rows at a time where its weight is
    large. Each row's quantization reads that row alone (per-channel or per-group scales), so the
    blocks put together are the whole weight quantized at once, bit for bit, with a fraction of
    its float temporaries."""
    from torchao.quantization import quantize_

    weight = linear.weight
    rows = max(1, ROW_BLOCK_BYTES // (weight.shape[1] * weight.element_size()))
    if weight.shape[0] <= rows:
        quantize_(linear, config)
        return
    blocks = []
    for start in range(0, weight.shape[0], rows):
        part = torch.nn.Linear(weight.shape[1], min(rows, weight.shape[0] - start), bias=False, device="meta")
        part.weight = torch.nn.Parameter(weight.detach()[start : start + rows], requires_grad=False)
        quantize_(part, config)
        blocks.append(part.weight)
    first = blocks[0]
    data = [torch.cat([getattr(b, name) for b in blocks]) for name in first.tensor_data_names]
    attributes = [getattr(first, name) for name in first.tensor_attribute_names]
    del blocks
    linear.weight = torch.nn.Parameter(type(first)(*data, *attributes), requires_grad=False)
