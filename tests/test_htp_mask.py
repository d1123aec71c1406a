"""The HTP form's mask floor: with scores as wide as a trained model's (beyond +-50), a masked slot
must stay below every visible score. The eager HTP form is the QNN shard's function before lowering."""

from __future__ import annotations

import pytest
import torch

from composite.lowering.qnn.htp_graph import QUANTIZED_MASK_FLOOR, htp_form
from composite.manifest import method_widths
from composite.model.default import default_model
from composite.runtime.chain import eager_chain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule

PROMPT = list(range(1, 30))
WIDTH, CONTEXT = 8, 64


def wide_score_model():
    """The default model with its query and key projections scaled so that scores span tens."""
    model = default_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wq.weight.mul_(5.0)
            layer.attention.wk.weight.mul_(5.0)
    return model


def logits_through(model, mask_floor) -> list[torch.Tensor]:
    """Logits of a prompt that spans several prefill chunks (so later chunks see masked cache
    slots) and of decode steps, with every layer in the HTP form."""
    modules = []
    for spec in plan_shards(model.args, 3):
        module = ShardModule(model, spec).eval()
        if len(spec.layers):
            form = htp_form(module, CONTEXT + WIDTH, linear_as_conv=False, mask_floor=mask_floor).eval()
            form.spec = spec
            module = form
        modules.append(module)
    chain = eager_chain(model, modules, method_widths(WIDTH), CONTEXT)
    generation = generate(chain, PROMPT, 8, Sampler(), keep_logits=True)
    return [generation.logits[p] for p in sorted(generation.logits)]


def test_the_scores_span_tens_as_a_trained_models_do():
    model = wide_score_model()
    layer = model.layers[0]
    with torch.no_grad():
        x = layer.attention_norm(model.tok_embeddings(torch.tensor([PROMPT])))
        q, k = layer.attention.wq(x), layer.attention.wk(x)
    head_dim = model.args.head_dim
    scores = q[0, :, :head_dim] @ k[0, :, :head_dim].T / head_dim**0.5
    assert scores.abs().max() > 25


@pytest.mark.parametrize("mask_floor", [None, QUANTIZED_MASK_FLOOR], ids=["fp16", "quantized"])
def test_the_htp_form_gives_the_models_logits(mask_floor):
    model = wide_score_model()
    expected = logits_through(model, mask_floor=-1e9)  # no floor that matters
    got = logits_through(model, mask_floor)
    assert max((a - b).abs().max().item() for a, b in zip(expected, got)) < 1e-3


def test_the_old_floor_of_minus_32_was_not_enough():
    model = wide_score_model()
    expected = logits_through(model, mask_floor=None)
    got = logits_through(model, mask_floor=-32.0)
    assert max((a - b).abs().max().item() for a, b in zip(expected, got)) > 1e-2
