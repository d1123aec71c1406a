"""The rotations (composite/model/rotation.py, `rotate`): of the residual stream and of each
feed-forward's hidden activation; the same model in float, a smaller error once quantized where one
channel carries an outlier, and the export's `auto`."""

from __future__ import annotations

import pytest
import torch

from composite.config import build_config
from composite.errors import UserError
from composite.lowering.xnnpack import quantize_linears
from composite.model.default import default_model
from composite.model.rotation import hidden_rotation, rotate, rotate_residual, rotation_matrix
from composite.placement_options import DEFAULT_OPTIONS
from conftest import run_cli

TOKENS = torch.tensor([[1, 17, 230, 45, 99, 301, 7, 12, 400, 5, 88, 120, 3, 64, 250, 11]])


@pytest.mark.parametrize("dim", [128, 576, 100])  # Hadamard 2^7, Hadamard 36 x 2^4, no Hadamard
def test_the_rotation_is_orthogonal_and_repeatable(dim):
    rotation = rotation_matrix(dim)
    assert rotation.dtype == torch.float64
    assert torch.allclose(rotation @ rotation.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    assert torch.equal(rotation, rotation_matrix(dim))
    assert not torch.equal(rotation, rotation_matrix(dim, seed=1))


def test_the_rotated_model_is_the_same_model_in_float():
    model, rotated = default_model(), default_model()
    rotate_residual(rotated)
    assert not torch.allclose(model.layers[0].attention.wq.weight, rotated.layers[0].attention.wq.weight)
    # the tied head got its own matrix: the embedding is not the head any more
    assert rotated.output.weight.data_ptr() != rotated.tok_embeddings.weight.data_ptr()
    expected, actual = model.forward_full(TOKENS), rotated.forward_full(TOKENS)
    assert (expected - actual).abs().max() < 1e-4 * expected.abs().max()


def test_a_table_rotated_a_block_of_rows_at_a_time_is_the_table_rotated_whole(monkeypatch):
    """Blocks of rows (so that a vocabulary-sized table never has a float64 copy) give the whole
    matrix's float64 product bit for bit, blocks that do not divide the rows included, a weight
    that writes the stream (R^T W, by rows of W^T) too, and leave the weights they read as they were."""
    from composite.model import rotation as rotation_module

    whole, blocked = default_model(), default_model()
    table = blocked.tok_embeddings.weight.data
    read, written = table.clone(), blocked.layers[0].attention.wo.weight.detach().clone()
    monkeypatch.setattr(rotation_module, "ROWS_AT_ONCE", 10**9)
    rotate(whole, "hadamard-ffn")
    monkeypatch.setattr(rotation_module, "ROWS_AT_ONCE", 100)  # the default vocabulary is 512 rows
    rotate(blocked, "hadamard-ffn")
    assert torch.equal(table, read)
    rotation = rotation_matrix(read.shape[1])
    assert torch.equal(blocked.tok_embeddings.weight, (read.double() @ rotation).float())
    assert torch.equal(blocked.layers[0].attention.wo.weight, (rotation.T @ written.double()).float())  # by rows of W^T
    for name, weight in whole.state_dict().items():
        assert torch.equal(weight, blocked.state_dict()[name]), name


@pytest.mark.parametrize("hidden_dim", [1536, 352, 8192, 7])  # 12 x 128, 11 x 32, 64 x 128, no power of 2
def test_the_hidden_rotation_is_an_orthogonal_kronecker_product_of_small_matrices(hidden_dim):
    rotation = hidden_rotation(hidden_dim)
    across, within = rotation.across_t.T.double(), rotation.within_t.T.double()
    assert within.shape[0] <= 128 and across.shape[0] * within.shape[0] == hidden_dim
    # kron(A, W) kron(A, W)^T = (A A^T) kron (W W^T): orthogonal factors make an orthogonal whole,
    # checked without the hidden_dim^3 product (30 s at 8192)
    for factor in (across, within):
        assert torch.allclose(factor @ factor.T, torch.eye(factor.shape[0], dtype=torch.float64), atol=1e-6)
    dense = torch.kron(across, within)
    x = torch.randn(2, 3, hidden_dim)
    assert torch.allclose(rotation(x).double(), x.double() @ dense, atol=1e-5)


def test_w2_reads_the_hidden_rotation_folded_in_as_the_dense_product_gives_it():
    """The fold is two small products per row (A^T X B), not the dense A kron B: each folded
    weight is the dense float64 product to float32 rounding."""
    from composite.model.rotation import rotate_hidden

    model = default_model()
    read = [layer.feed_forward.w2.weight.detach().clone() for layer in model.layers]
    rotate_hidden(model)
    rotation = hidden_rotation(model.args.hidden_dim)
    dense = torch.kron(rotation.across_t.T.double(), rotation.within_t.T.double())
    for weight, layer in zip(read, model.layers):
        exact = weight.double() @ dense
        assert torch.allclose(layer.feed_forward.w2.weight.double(), exact, rtol=2**-23, atol=0)


def test_the_model_with_both_rotations_is_the_same_model_in_float():
    model, rotated = default_model(), default_model()
    rotate(rotated, "hadamard-ffn")
    assert all(layer.feed_forward.hidden_rotation is not None for layer in rotated.layers)
    expected, actual = model.forward_full(TOKENS), rotated.forward_full(TOKENS)
    assert (expected - actual).abs().max() < 1e-4 * expected.abs().max()


def kld_of_8da8w(model, reference: torch.Tensor) -> float:
    options = {**DEFAULT_OPTIONS["xnnpack"], "quantize": "8da8w"}
    quantized, _ = quantize_linears(model, options)
    with torch.no_grad():
        logq = torch.log_softmax(quantized.forward_full(TOKENS).double(), -1)
    logp = torch.log_softmax(reference.double(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def test_rotation_spreads_an_outlier_channel_and_8da8w_loses_less():
    """Trained models carry a few channels far larger than the rest in every token; per-token
    int8 activations then spend their range on them. Here channel 7 of every embedding row x 60."""
    model = default_model()
    with torch.no_grad():
        model.tok_embeddings.weight[:, 7] *= 60.0
        reference = model.forward_full(TOKENS)
    plain = kld_of_8da8w(model, reference)
    rotate_residual(model)
    rotated = kld_of_8da8w(model, reference)
    assert rotated < 0.5 * plain, (plain, rotated)


def test_the_hidden_rotation_spreads_a_feed_forward_outlier_and_8da8w_loses_less():
    """SwiGLU's product can put thousands into a few hidden channels (SmolLM2's w2 inputs), where
    the residual rotation does not reach. Here hidden channel 5 of every layer x 60 (w2 reads it
    / 60, the same model)."""
    model = default_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.feed_forward.w3.weight[5] *= 60.0
            layer.feed_forward.w2.weight[:, 5] /= 60.0
        reference = model.forward_full(TOKENS)
    rotate(model, "hadamard")
    residual_only = kld_of_8da8w(model, reference)
    rotated = default_model()
    with torch.no_grad():
        for layer in rotated.layers:
            layer.feed_forward.w3.weight[5] *= 60.0
            layer.feed_forward.w2.weight[:, 5] /= 60.0
    rotate(rotated, "hadamard-ffn")
    both = kld_of_8da8w(rotated, reference)
    assert both < 0.5 * residual_only, (residual_only, both)


@pytest.mark.parametrize(
    "values, expected",
    [
        ({}, "none"),
        ({"xnnpack": {"quantize": "8da8w"}}, "hadamard-ffn"),
        ({"xnnpack": {"quantize": "8da4w"}}, "none"),
        ({"xnnpack": {"quantize": "8da8w"}, "rotate": "none"}, "none"),
        ({"xnnpack": {"quantize": "8da4w"}, "rotate": "hadamard"}, "hadamard"),
        ({"shards": 2, "placement": [{"backend": "xnnpack", "quantize": "8da8w"}, "xnnpack"]}, "hadamard-ffn"),
        ({"xnnpack": {"quantize": "8da8w"}, "rotate": "hadamard"}, "hadamard"),
        (
            {
                "shards": 2,
                "placement": [{"backend": "xnnpack", "quantize": "8da8w"}, {"backend": "qnn", "precision": "16a4w"}],
            },
            "none",
        ),
        ({"shards": 2, "placement": [{"backend": "xnnpack", "quantize": "8da8w"}, "qnn"]}, "hadamard-ffn"),
        (
            {
                "shards": 2,
                "placement": [{"backend": "xnnpack", "quantize": "8da8w"}, {"backend": "qnn", "precision": "16a8w"}],
            },
            "hadamard",
        ),
        ({"placement": "qnn"}, "none"),
        ({"placement": "qnn", "qnn": {"precision": "16a8w"}}, "hadamard"),
        ({"placement": "qnn", "qnn": {"precision": "16a8w", "overrides": {"layers.0": "16a4w"}}}, "none"),
        ({"placement": "qnn", "qnn": {"precision": "16a4w_block"}}, "hadamard-ffn"),
        ({"placement": "qnn", "qnn": {"precision": "16a4w_block", "overrides": {"output": "16a8w"}}}, "hadamard-ffn"),
        ({"placement": "qnn", "qnn": {"precision": "16a8w", "overrides": {"layers.0": "16a4w_block"}}}, "hadamard-ffn"),
        (
            {
                "shards": 2,
                "placement": [
                    {"backend": "xnnpack", "quantize": "8da4w"},
                    {"backend": "qnn", "precision": "16a4w_block"},
                ],
            },
            "none",
        ),
    ],
)
def test_auto_rotates_8_bit_and_block_wise_4_bit_weights_not_other_4_bit_ones(values, expected):
    assert build_config(None, values).rotation() == expected


def test_an_unknown_rotation_is_refused(tmp_path):
    with pytest.raises(UserError, match="rotate must be one of auto, none, hadamard, hadamard-ffn; got 'quarot'"):
        build_config(None, {"rotate": "quarot"})
    result = run_cli("composite.export", "--rotate", "quarot", "--output", str(tmp_path / "x"))
    assert result.returncode == 2 and "invalid choice: 'quarot'" in result.stderr


@pytest.mark.parametrize("precision, weight_max", [("16a4w_block", 32767), ("16a8w", 32767), ("8a8w", 127)])
def test_qnn_keeps_16_bit_weights_for_the_online_rotation_in_16_bit_activation_shards(qnn_ready, precision, weight_max):
    """The feed-forward's online rotation is two matmuls by constant matrices: with 4-bit weights the
    HTP computes them otherwise than the quantized graph (lowering/qnn/quantizer.py), so in shards
    of 16-bit activations they get 16-bit weights; the model's own linears keep the precision's."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from composite.lowering.qnn.shard import QnnShardLowering
    from composite.manifest import DECODE
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule, shard_io

    model = default_model().eval()
    rotate(model, "hadamard-ffn")
    spec = plan_shards(model.args, 3, None)[1]
    inputs, outputs = shard_io(model.args, spec, 1, 32)
    examples = {DECODE: tuple(t.example() for t in inputs)}
    names = {DECODE: ([t.name for t in inputs], [t.name for t in outputs])}
    options = {**DEFAULT_OPTIONS["qnn"], "precision": precision, "weight_sharing": False, "rounding": "nearest"}
    job = QnnShardLowering(ShardModule(model, spec).eval(), examples, names, options, 33)
    job.observe(DECODE, examples[DECODE])
    graph = convert_pt2e(job.graphs[DECODE])

    def weight_range(node):
        weight = node.args[1]
        assert weight.op == "call_function" and "dequantize" in str(weight.target), weight
        return weight.args[4:6]  # quant_min, quant_max of a per-channel dequantize

    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    rotation = [weight_range(n) for n in calls if n.target == torch.ops.aten.linear.default]
    model_weights = [weight_range(n) for n in calls if n.target == torch.ops.aten.conv2d.default]
    assert len(rotation) == 2 * len(spec.layers)
    assert set(rotation) == {(-weight_max, weight_max)}
    assert (-weight_max, weight_max) not in set(model_weights) or precision == "8a8w"
