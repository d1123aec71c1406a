"""16a4w_block weights as the HTP computes them: LPBQ, QNN's block-wise 4-bit weights.

QNN stores a 4-bit weight per input channel of a block, a float scale per output channel, and per
block a 4-bit multiple of it: a block's scale is k/16 of its channel's, k in 1..16 (QNN's
"blockwise expansion", its block scales kept in 8 bits). ExecuTorch's observer gives each block a
scale of its own (its largest magnitude / 7) and the weights are rounded with it; its QNN builder
then rounds each scale to the channel's grid (backends/qualcomm/builders/node_visitor.py:
make_qnn_per_block_config), so the HTP multiplies the weights by scales up to half a step of that
grid away from the ones they were rounded for, and the quantized graph PyTorch runs is not what the
HTP computes. Here the scales are on the grid before the weights are rounded with them: the builder
finds each k again exactly, and the converted graph is the HTP's arithmetic.

Within the grid each channel's scale and each block's k are chosen by the weights' squared error
(range setting): a channel scale below its largest block's unclipped one clips that block's
largest weights and gives every other block a finer grid.
"""

from __future__ import annotations

import torch
from executorch.backends.qualcomm.quantizer.observers.per_block_param_observer import PerBlockParamObserver

STEPS = 16  # a block's scale is k / STEPS of its channel's, k in 1..STEPS
CLIP = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # channel scales tried, as fractions of the unclipped one


def lpbq_scales(weight: torch.Tensor, block: int, qmax: int = 7, clip: tuple[float, ...] = CLIP) -> torch.Tensor:
    """[out, in // block] block scales on the LPBQ grid for `weight` [out, in]: each a multiple
    k in 1..STEPS of its channel's scale / STEPS, and in every channel some block's k is STEPS (what
    QNN's builder divides by). Per channel, the scale among `clip` fractions of the unclipped one,
    and per block, k (the smallest that clips nothing there, or one or two below it), with the
    least squared error of the weights rounded to [-qmax, qmax]."""
    out, width = weight.shape
    w = weight.detach().float().reshape(out, width // block, block)
    unclipped = (w.abs().amax(-1) / qmax).clamp(min=torch.finfo(torch.float32).tiny)  # [out, blocks]
    top = unclipped.amax(-1, keepdim=True)
    best_error = torch.full((out,), float("inf"))
    best = torch.empty_like(unclipped)
    rounded = torch.empty_like(w)  # one buffer for every candidate's rounding (in place: no page faults)
    for fraction in clip:
        unit = top * fraction / STEPS  # [out, 1]
        least = torch.ceil(unclipped / unit).clamp(1, STEPS)
        chosen, chosen_error = least * unit, None
        for lower in (0, 1, 2):
            # a block that needs the full scale keeps it: the channel's grid is k / STEPS of it
            k = torch.where(least == STEPS, least, (least - lower).clamp(min=1))
            scale = k * unit
            torch.div(w, scale.unsqueeze(-1), out=rounded)
            rounded.round_().clamp_(-qmax, qmax).mul_(scale.unsqueeze(-1)).sub_(w).square_()
            error = rounded.sum(-1)
            if chosen_error is None:
                chosen_error = error
            else:
                better = error < chosen_error
                chosen = torch.where(better, scale, chosen)
                chosen_error = torch.where(better, error, chosen_error)
        total = chosen_error.sum(-1)
        improved = total < best_error
        best[improved] = chosen[improved]
        best_error = torch.minimum(total, best_error)
    return best


class LpbqObserver(PerBlockParamObserver):
    """ExecuTorch's per-block weight observer with its scales on the LPBQ grid (lpbq_scales)."""

    def forward(self, input: torch.Tensor):
        if input.numel() and not self.calibrated:
            self.weight = input.detach()
        return super().forward(input)

    def calculate_qparams(self):
        if getattr(self, "grid", None) is not None:  # the search is costly: once per weight
            return self.grid
        scale, zero_point = super().calculate_qparams()  # the shapes and dtypes QNN's builder reads
        weight = self.weight
        if (
            weight.dim() < 2
            or any(n != 1 for n in weight.shape[2:])
            or tuple(self.block_size[::2]) != (1,) * len(self.block_size[::2])
        ):
            raise ValueError(f"LPBQ here is for 1x1 convolutions in blocks of input channels, not {self.block_size}")
        rows = weight.reshape(weight.shape[0], weight.shape[1])  # [out, in]
        grid = lpbq_scales(rows, self.block_size[1], qmax=self.quant_max)
        self.grid = grid.reshape(scale.shape).to(scale.dtype), zero_point
        self.weight = None  # the scales are all it was kept for: a rounded copy may replace it
        return self.grid
