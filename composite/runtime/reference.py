"""The unsplit eager PyTorch model, rebuilt from the export's source weights, for comparison."""

from __future__ import annotations

import time

import torch

from composite.errors import UserError
from composite.model.checkpoint import load_checkpoint
from composite.model.default import default_model
from composite.model.llama import ModelArgs, Transformer
from composite.model.rotation import rotate
from composite.runtime.chain import eager_chain
from composite.runtime.generate import Generation, Limits, stop_reason
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule


def reference_chain(manifest: dict):
    """The float model as one eager shard with the runners' KV cache, for a --reference chat."""
    model = reference_model(manifest)
    spec = plan_shards(model.args, 1)[0]
    return eager_chain(model, [ShardModule(model, spec).eval()], manifest["methods"], manifest["max_seq_len"])


def reference_model(manifest: dict, in_export_basis: bool = False) -> Transformer:
    """The float model of the export's checkpoint; in_export_basis: with the residual stream
    rotated as the export's shards have it (to compare a shard's hidden state with), else as the
    checkpoint has it (the same logits)."""
    source = manifest["source"]
    if source["kind"] == "embedded":
        model = default_model(ModelArgs(**manifest["model"]))
    else:
        if source["path"] is None:
            raise UserError("the manifest does not record the checkpoint path, so --reference cannot rebuild the model")
        model = load_checkpoint(source["path"], None).model
    if model.args.to_dict() != manifest["model"]:
        raise UserError("the source checkpoint no longer matches the export's model hyper-parameters")
    if in_export_basis:
        rotate(model, source.get("rotation", "none"))
    return model


@torch.no_grad()
def generate_reference(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    sampler,
    eos_ids=(),
    keep_logits=False,
    on_token=None,
    seq_len: int | None = None,
) -> Generation:
    """Greedy/sampled generation recomputing the full sequence every step (no cache at all)."""
    limits = Limits(max_new_tokens, seq_len or max_seq_len, max_seq_len, tuple(eos_ids))
    limits.check(prompt)
    generation = Generation(list(prompt))
    sequence = list(prompt)
    started = time.perf_counter()
    while True:
        logits = model.forward_full(torch.tensor([sequence]))[0]
        if keep_logits:
            for position in range(len(generation.logits), len(sequence)):
                generation.logits[position] = logits[position]
        token = sampler(logits[-1])
        if not generation.tokens:
            generation.first_token_seconds = generation.prefill_seconds = time.perf_counter() - started
        generation.tokens.append(token)
        sequence.append(token)
        if on_token is not None:
            on_token(token)
        generation.stop_reason = stop_reason(token, len(generation.tokens), len(sequence), limits)
        if generation.stop_reason:
            break
    generation.decode_seconds = time.perf_counter() - started - generation.prefill_seconds
    generation.decode_calls = len(generation.tokens) - 1
    return generation
