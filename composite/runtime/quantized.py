"""Quantized tensors as the manifest describes them (dtype uint8 / uint16 with a scale and zero
point), and the one conversion both runners apply where a quantized tensor meets a float one:
q = floor(clamp(x * (1 / scale) + zero_point, 0, qmax) + 0.5) and x = (q - zero_point) * scale, in
float32 (runner_cpp/quantized.cpp computes the same, bit for bit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16}


@dataclass(frozen=True)
class QuantParams:
    dtype: torch.dtype
    scale: float
    zero_point: int

    def entry(self) -> dict:
        return {"scale": self.scale, "zero_point": self.zero_point}

    @property
    def qmax(self) -> int:
        return torch.iinfo(self.dtype).max

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        inverse = torch.tensor(1.0 / self.scale, dtype=torch.float32)
        v = x.to(torch.float32) * inverse + float(self.zero_point)
        return torch.floor(v.clamp(0, self.qmax) + 0.5).to(self.dtype)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return (q.to(torch.float32) - float(self.zero_point)) * torch.tensor(self.scale, dtype=torch.float32)

    @staticmethod
    def of(entry: dict) -> QuantParams | None:
        """The encoding of a manifest tensor entry; None for a float (or integer index) tensor."""
        if "quant" not in entry:
            return None
        quant = entry["quant"]
        return QuantParams(TORCH_DTYPES[entry["dtype"]], float(quant["scale"]), int(quant["zero_point"]))


def convert(x: torch.Tensor, source: QuantParams | None, target: QuantParams | None) -> torch.Tensor:
    """x, encoded as `source` (None: float32), re-encoded as `target`."""
    if source == target:
        return x
    if source is not None:
        x = source.dequantize(x)
    return target.quantize(x) if target is not None else x
