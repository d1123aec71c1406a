"""The embedding table of the shard that holds it, quantized: 8-bit or 4-bit integers with one
float16 scale per row or per group of columns, looked up by ExecuTorch's quantized embedding
kernels (quantized_decomposed::embedding_byte / embedding_4bit), which composite_runner links and
composite.run loads. With tied embeddings the head keeps its own copy of the matrix, quantized as
its shard's linears are, unless the table is stored once (lowering/shared_table.py): the 8-bit
lookup then holds the head's own int8 matrix and float32 scales."""

from __future__ import annotations

import torch
from torch import nn

from composite.errors import UserError
from composite.units import MB

BITS = (4, 8)


def load_kernels() -> None:
    """The ops' definitions for export and eager, and their kernels for ExecuTorch's Python runtime."""
    import executorch.exir.passes._quant_patterns_and_replacements
    import executorch.kernels.quantized  # noqa: F401


class QuantizedEmbedding(nn.Module):
    """weight: int8 [vocab, dim] (8-bit) or uint8 [vocab, dim/2] holding two 4-bit values per byte,
    the even column in the high nibble, each stored +8; scales: float16 [vocab, groups]."""

    ROW_BLOCK = 8192  # rows quantized at once: the float temporaries of a block, not of the table

    def __init__(self, table: torch.Tensor | None, bits: int, group_size: int, quantized=None):
        """quantized: (int8 [vocab, dim], scales [vocab]) already made (8-bit, a scale per row)
        instead of `table` quantized here."""
        super().__init__()
        load_kernels()
        if quantized is not None:
            packed, scales = quantized
            bits, group = 8, packed.shape[1]
        else:
            vocab, dim = table.shape
            group = group_size or dim
            packed = torch.empty(
                (vocab, dim // 2 if bits == 4 else dim), dtype=torch.uint8 if bits == 4 else torch.int8
            )
            scales = torch.empty((vocab, dim // group), dtype=torch.float16)
            for start in range(0, vocab, self.ROW_BLOCK):
                rows = slice(start, start + self.ROW_BLOCK)
                packed[rows], scales[rows] = quantize_rows(table.detach()[rows], bits, group)
            scales = scales if scales.shape[1] > 1 else scales[:, 0].contiguous()
        self.bits, self.group = bits, group
        self.output_dtype = torch.float32  # float16 in an fp16 shard, whose hidden state is float16
        self.register_buffer("weight", packed)
        self.register_buffer("scales", scales)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.bits == 4:
            return torch.ops.quantized_decomposed.embedding_4bit.dtype(
                self.weight, self.scales, None, -8, 7, tokens, dtype=self.output_dtype
            )
        return torch.ops.quantized_decomposed.embedding_byte.dtype(
            self.weight, self.scales, None, -128, 127, tokens, dtype=self.output_dtype
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 table this one stands for: what the kernels compute, row by row."""
        if self.bits == 4:
            high, low = (self.weight // 16).to(torch.int8) - 8, (self.weight % 16).to(torch.int8) - 8
            q = torch.stack((high, low), dim=-1).reshape(self.weight.shape[0], -1)
        else:
            q = self.weight
        scales = self.scales.float().reshape(q.shape[0], -1)
        return (q.reshape(q.shape[0], scales.shape[1], -1).float() * scales[..., None]).reshape(q.shape)

    def stored_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_rows(rows: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed values, float16 scales [rows, groups]) of a block of the table's rows."""
    count, dim = rows.shape
    qmax = 2 ** (bits - 1) - 1
    groups = rows.float().reshape(count, dim // group, group)
    # Symmetric: zero stays exactly zero, and the kernels need no zero points.
    scales = (groups.abs().amax(dim=-1) / qmax).clamp(min=torch.finfo(torch.float16).tiny).half()
    q = torch.round(groups / scales.float()[..., None]).clamp(-qmax - 1, qmax).to(torch.int8).reshape(count, dim)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8).reshape(count, dim // 2, 2)
        return nibbles[..., 0] * 16 + nibbles[..., 1], scales
    return q, scales


def check(dim: int, bits: int, group_size: int) -> None:
    if group_size and dim % group_size:
        raise UserError(f"embedding_quantize group size {group_size} does not divide the model's dim {dim}")
    if bits == 4 and (group_size or dim) % 2:
        raise UserError("embedding_quantize 4-bit packs two values per byte: the group size must be even")


def quantize(
    shard, bits: int, group_size: int, head_shard: int, tied: bool, shared_mapping: str | None = None
) -> list[str]:
    """Swaps the shard's embedding for its quantized form; -> notes on the bytes of each copy.
    shared_mapping: the table is stored once with the head's (lowering/shared_table.py), quantized
    as the head is with this torchao weight mapping."""
    table = shard.tok_embeddings.weight
    check(table.shape[1], bits, group_size)
    if shared_mapping is not None:
        from composite.lowering import shared_table

        quantized = QuantizedEmbedding(None, bits, group_size, shared_table.quantized_as_head(table, shared_mapping))
    else:
        quantized = QuantizedEmbedding(table, bits, group_size)
    shard.tok_embeddings = quantized
    grouping = f"groups of {group_size}" if group_size else "one scale per row"
    notes = [
        f"embedding {bits}-bit, {grouping}: {quantized.stored_bytes() / MB:.2f} MB "
        f"(float32 {table.numel() * 4 / MB:.2f} MB)"
    ]
    if shared_mapping is not None:
        notes.append(f"tied embeddings: the table is stored once, shared with the head in shard {head_shard}")
    elif tied:
        notes.append(
            f"tied embeddings: the head in shard {head_shard} keeps its own copy "
            f"({table.numel() * 4 / MB:.2f} MB as float32, quantized as that shard's linears are)"
        )
    return notes
