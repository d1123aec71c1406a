"""The residual stream rotated by an orthogonal matrix folded into the weights (QuaRot's and
SpinQuant's R1): the same model in float, an easier one to quantize.

Every RMSNorm's weight is first folded into the linears that read its output (a norm without a
weight commutes with an orthogonal R: ||xR|| = ||x||). Then every weight that reads the residual
stream (the embedding's rows, wq, wk, wv, w1, w3 and the head) is multiplied by R on its input
side and every weight that writes it (wo, w2) by R^T on its output side. The residual stream then
carries h R instead of h: the logits are the same to float32 rounding, but an activation that
lives in one channel (SmolLM2's ~25,000 on its first token, the outlier channels of trained
models) is spread over all of them, so a per-token int8 scale or a per-tensor 16-bit range is no
longer set by one channel. R is a randomized Hadamard matrix (torchao's construction) where the
model's dim allows one, else a seeded random orthogonal matrix; both are fixed by `seed`, so an
export is repeatable.

The rotation is model-wide: every shard of an export carries the rotated weights and passes the
rotated hidden state to the next, so it is one setting of the export (`rotate`), recorded in the
manifest, from which composite.eval rebuilds the float shards it compares each shard against.

"hadamard-ffn" adds QuaRot's online R4: every feed-forward's hidden activation (w2's input, where
SwiGLU leaves outliers in the thousands that R1 cannot reach) is rotated at run time by an
orthogonal H = A kron B, and w2 reads H folded into its weight. B is a randomized Hadamard matrix
of at most 128 (a power of two), A one of the rest of hidden_dim (or random orthogonal), so the
op is two small matmuls per layer (model/llama.py's KroneckerRotation), not a dense
[hidden_dim, hidden_dim] one."""

from __future__ import annotations

import contextlib
import io

import torch

from composite.model.llama import KroneckerRotation, RMSNorm, Transformer
from composite.model.loaded import is_materialized

SEED = 0


def rotation_matrix(dim: int, seed: int = SEED) -> torch.Tensor:
    """An orthogonal [dim, dim] float64 matrix: a randomized Hadamard matrix when dim is K * 2^m
    for a K torchao has a Hadamard matrix of, else a random orthogonal one (QR of a Gaussian)."""
    with contextlib.redirect_stdout(io.StringIO()):  # torchao prints a note on import
        from torchao.prototype.spinquant.hadamard_utils import random_hadamard_matrix

    try:
        return random_hadamard_matrix(dim, "cpu", seed=seed).to(torch.float64)
    except AssertionError:  # torchao asserts when it has no Hadamard matrix of this size
        generator = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))  # the sign fix makes QR's factor unique


# Rows of a weight taken to float64 at once. The arithmetic is float64 for accuracy; on a whole
# vocabulary-sized table it held two float64 copies of it, four times its float32 bytes (the
# largest memory of a 3B export's float pass: docs/scale.md); a block of rows holds a few MB.
ROWS_AT_ONCE = 512


def _by_rows(weight: torch.Tensor, change) -> torch.Tensor:
    """A new float32 weight: change(rows as float64) for each block of `weight`'s rows. Row i of
    the result depends on row i alone, so the blocks give what the whole matrix would."""
    out = torch.empty_like(weight)
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        out[start : start + ROWS_AT_ONCE] = change(weight[start : start + ROWS_AT_ONCE].double())
    return out


def _fold_norm(norm: RMSNorm, readers: list[torch.nn.Linear]) -> None:
    scale = norm.weight.data.double()
    for linear in readers:
        linear.weight.data = _by_rows(linear.weight.data, lambda rows: rows * scale)
    norm.weight.data = torch.ones_like(norm.weight.data)


def _reads(module, rotation: torch.Tensor) -> None:
    module.weight.data = _by_rows(module.weight.data, lambda rows: rows @ rotation)


def _writes(linear: torch.nn.Linear, rotation: torch.Tensor) -> None:
    # R^T W as (W^T R)^T: by rows of W^T, so that W (w2: 100 MB a 3B layer) has no float64 copy
    linear.weight.data = _by_rows(linear.weight.data.T, lambda rows: rows @ rotation).T.contiguous()


@torch.no_grad()
def rotate_residual(model: Transformer, seed: int = SEED) -> None:
    """Rotates `model`'s residual stream in place (see the module's docstring). A tied head gets
    its own matrix: it reads the final norm's weight folded in, the embedding does not. Parts on
    the meta device (a model read one shard at a time: model/loaded.py) are left as they are;
    each part is rotated alone, so a part rotated here is the same part of the whole model rotated."""
    rotation = rotation_matrix(model.args.dim, seed)
    for layer in model.layers:
        if not is_materialized(layer):
            continue
        attention, feed_forward = layer.attention, layer.feed_forward
        _fold_norm(layer.attention_norm, [attention.wq, attention.wk, attention.wv])
        _fold_norm(layer.ffn_norm, [feed_forward.w1, feed_forward.w3])
        for linear in (attention.wq, attention.wk, attention.wv, feed_forward.w1, feed_forward.w3):
            _reads(linear, rotation)
        _writes(attention.wo, rotation)
        _writes(feed_forward.w2, rotation)
    if is_materialized(model.output):
        model.output.weight = torch.nn.Parameter(model.output.weight.data.clone())
        _fold_norm(model.norm, [model.output])
        _reads(model.output, rotation)
    if is_materialized(model.tok_embeddings):
        _reads(model.tok_embeddings, rotation)


def hidden_rotation_sizes(hidden_dim: int) -> tuple[int, int]:
    """(a, b) of the online rotation A kron B of a hidden activation: b the largest power of two
    <= 128 that divides hidden_dim."""
    within = 1
    while within < 128 and hidden_dim % (within * 2) == 0:
        within *= 2
    return hidden_dim // within, within


def hidden_rotation(hidden_dim: int, seed: int = SEED) -> KroneckerRotation:
    """The online rotation of a hidden activation of `hidden_dim` (float32)."""
    across_size, within = hidden_rotation_sizes(hidden_dim)
    across = rotation_matrix(across_size, seed) if across_size > 1 else torch.ones(1, 1)
    return KroneckerRotation(across.float(), rotation_matrix(within, seed + 1).float())


@torch.no_grad()
def rotate_hidden(model: Transformer, seed: int = SEED) -> None:
    """Gives every feed-forward the online rotation of its hidden activation and folds the inverse
    into w2: (h H)(W2 H)^T = h W2^T."""
    rotation = hidden_rotation(model.args.hidden_dim, seed)
    # w2's rows times A kron B by the run-time op itself in float64: two small products, not the
    # dense [hidden_dim, hidden_dim] matrix (512 MB in float64 and 15 s a 3B layer)
    folded = KroneckerRotation(rotation.across_t.T.double(), rotation.within_t.T.double())
    for layer in model.layers:
        if not is_materialized(layer):
            continue
        feed_forward = layer.feed_forward
        feed_forward.w2.weight.data = _by_rows(feed_forward.w2.weight.data, folded)
        feed_forward.hidden_rotation = KroneckerRotation(rotation.across_t.T.clone(), rotation.within_t.T.clone())


def rotate(model: Transformer, rotation: str) -> None:
    """Applies an export's `rotate` setting ("none", "hadamard" or "hadamard-ffn") to `model`."""
    if rotation in ("hadamard", "hadamard-ffn"):
        rotate_residual(model)
    if rotation == "hadamard-ffn":
        rotate_hidden(model)
