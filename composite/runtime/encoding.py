"""How a hidden state or KV cache crosses a shard boundary, as the manifest describes it: float32
(no Encoding), float16, or uint8 / uint16 with a scale and zero point. Where a tensor meets a shard
that wants another encoding, both runners convert through float32 with the same arithmetic:
  quantize    q = floor(clamp(x * (1 / scale) + zero_point, 0, qmax) + 0.5)   (float32 steps)
  dequantize  x = (q - zero_point) * scale
  float16     round to nearest even, and back exactly
runner_cpp/encoding.cpp computes the same, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_DTYPES = {"float16": torch.float16, "uint8": torch.uint8, "uint16": torch.uint16}


@dataclass(frozen=True)
class Encoding:
    dtype: torch.dtype  # float16, uint8 or uint16
    scale: float | None = None  # quantized dtypes only
    zero_point: int | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def quant_entry(self) -> dict | None:
        """The manifest's "quant" of a tensor in this encoding (None for float16)."""
        return {"scale": self.scale, "zero_point": self.zero_point} if self.quantized else None

    @property
    def empty_value(self) -> int:
        """What 0.0 is in this encoding (an empty cache slot)."""
        return self.zero_point if self.quantized else 0

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if not self.quantized:
            return x.to(self.dtype)
        inverse = torch.tensor(1.0 / self.scale, dtype=torch.float32)
        v = x * inverse + float(self.zero_point)
        return torch.floor(v.clamp(0, torch.iinfo(self.dtype).max) + 0.5).to(self.dtype)

    def decode(self, q: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return q.to(torch.float32)
        return (q.to(torch.float32) - float(self.zero_point)) * torch.tensor(self.scale, dtype=torch.float32)

    @staticmethod
    def of(entry: dict) -> Encoding | None:
        """The encoding of a manifest tensor entry; None for float32 (or an integer index)."""
        if entry["dtype"] not in TORCH_DTYPES:
            return None
        quant = entry.get("quant")
        if quant is None:
            return Encoding(TORCH_DTYPES[entry["dtype"]])
        return Encoding(TORCH_DTYPES[entry["dtype"]], float(quant["scale"]), int(quant["zero_point"]))


def convert(x: torch.Tensor, source: Encoding | None, target: Encoding | None) -> torch.Tensor:
    """x, in encoding `source` (None: float32), re-encoded as `target`."""
    if source == target:
        return x
    if source is not None:
        x = source.decode(x)
    return target.encode(x) if target is not None else x
