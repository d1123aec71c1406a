"""4-bit QNN weights: LPBQ's block scales on the HTP's grid (composite/lowering/qnn/lpbq.py) and GPTQ's
rounding (composite/lowering/qnn/weight_rounding.py), on random weights, in PyTorch."""

from __future__ import annotations

import pytest
import torch

from composite.lowering.qnn.lpbq import STEPS, lpbq_scales
from composite.lowering.qnn.weight_rounding import DAMPING, gptq

BLOCK = 32


def weights_and_inputs(out: int = 96, width: int = 256, rows: int = 2048):
    generator = torch.Generator().manual_seed(0)
    weight = 0.02 * torch.randn(out, width, generator=generator)
    weight[:, 7] *= 12  # a column of large weights, in one block of each channel
    x = torch.randn(rows, width, generator=generator) @ torch.randn(width, width, generator=generator) * 0.1
    x[:, 3] *= 30  # an outlier input channel
    return weight, x


def qnn_builders_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """ExecuTorch 1.5.1's QNN builder (node_visitor.make_qnn_per_block_config): each block's scale
    as a 4-bit multiple of its channel's largest / 16, the scales the HTP multiplies by."""
    unit = scales.amax(dim=-1) / STEPS
    k = torch.clamp(torch.round(scales / unit.unsqueeze(-1)), 1, STEPS)
    return k * unit.unsqueeze(-1)


def rounded(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    per_weight = scales.repeat_interleave(BLOCK, dim=1)
    return (weight / per_weight).round().clamp(-7, 7) * per_weight


def test_block_scales_are_on_the_grid_the_htp_reads():
    weight, _ = weights_and_inputs()
    scales = lpbq_scales(weight, BLOCK)
    assert scales.shape == (weight.shape[0], weight.shape[1] // BLOCK)
    unit = scales.amax(-1, keepdim=True) / STEPS
    k = scales / unit
    assert torch.allclose(k, k.round(), atol=1e-5) and k.min() >= 1 and k.max() <= STEPS
    assert torch.equal(qnn_builders_block_scales(scales), scales)  # the builder finds each k again


def test_block_scales_on_the_grid_round_the_weights_closer_than_executorchs():
    """ExecuTorch's observer rounds the weights with each block's own scale (largest / 7); the HTP
    then multiplies them by the builder's rounded scales. Ours: scales on the grid, searched."""
    weight, _ = weights_and_inputs()
    own = weight.reshape(weight.shape[0], -1, BLOCK).abs().amax(-1) / 7
    per_weight = own.repeat_interleave(BLOCK, dim=1)
    executorch = (weight / per_weight).round().clamp(-7, 7) * qnn_builders_block_scales(own).repeat_interleave(
        BLOCK, dim=1
    )
    ours = rounded(weight, lpbq_scales(weight, BLOCK))
    assert (weight - ours).square().sum() < 0.85 * (weight - executorch).square().sum()


def test_gptq_rounds_onto_the_same_grid_with_a_smaller_output_error():
    weight, x = weights_and_inputs()
    scales = lpbq_scales(weight, BLOCK)
    per_weight = scales.repeat_interleave(BLOCK, dim=1)
    ours = gptq(weight, x.T.double() @ x.double(), per_weight, 7)
    steps = ours / per_weight
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 7 + 1e-4
    nearest = rounded(weight, scales)

    def output_error(quantized):
        return (x @ (weight - quantized).T).square().mean()

    assert output_error(ours) < 0.5 * output_error(nearest)


@pytest.mark.parametrize("dead", [True, False])
def test_gptq_keeps_a_channel_no_input_reaches_at_zero(dead):
    weight, x = weights_and_inputs()
    if dead:
        x[:, 11] = 0
    scales = lpbq_scales(weight, BLOCK).repeat_interleave(BLOCK, dim=1)
    ours = gptq(weight, x.T @ x, scales, 7)
    assert torch.isfinite(ours).all()
    assert (ours[:, 11] == 0).all() == dead


def plain_gptq(weight, hessian, scales, qmax: int) -> torch.Tensor:
    """GPTQ as its paper writes it (Frantar et al. 2023, algorithm 1), unbatched, in float64:
    columns by decreasing H diagonal, each rounded to its grid and its error spread over the columns
    not yet rounded through the upper Cholesky factor of H^-1 (dead channels zeroed, H damped)."""
    order = torch.argsort(hessian.diagonal(), descending=True)
    w = weight.double()[:, order].clone()
    s = scales.double()[:, order]
    h = hessian.double()[order][:, order].clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMPING * h.diagonal().mean() * torch.eye(len(h), dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.zeros_like(w)
    for i in range(w.shape[1]):
        q[:, i] = (w[:, i] / s[:, i]).round().clamp(-qmax, qmax) * s[:, i]
        error = (w[:, i] - q[:, i]) / u[i, i]
        w[:, i + 1 :] -= error[:, None] * u[i, i + 1 :][None, :]
    return q[:, torch.argsort(order)]


def test_gptq_is_the_papers_algorithm_batched():
    """Our lazy-batched float32 GPTQ picks the grid step the plain algorithm picks for all but a
    few weights (near-ties, where float32 and float64 part), and its output error is the same."""
    weight, x = weights_and_inputs()
    per_weight = lpbq_scales(weight, BLOCK).repeat_interleave(BLOCK, dim=1)
    hessian = x.T.double() @ x.double()
    ours = gptq(weight, hessian, per_weight, 7).double()
    plain = plain_gptq(weight, hessian, per_weight, 7)
    same = ((ours / per_weight).round() == (plain / per_weight).round()).double().mean()
    assert same > 0.999, float(same)

    def output_error(quantized):
        return (x.double() @ (weight.double() - quantized).T).square().mean()

    assert abs(float(output_error(ours) / output_error(plain)) - 1) < 0.01
