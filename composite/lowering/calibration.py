"""Calibration inputs for quantized shards, captured from the float model itself.

A shard in the middle of the model sees hidden states, positions, masks and KV caches, not text.
The float shards are chained exactly as the runners chain the exported ones (runtime/chain.py),
text is pushed through them (prefill chunks, then teacher-forced decode steps, so caches are
partly filled as in real use) and the inputs each quantized shard receives are recorded per method.

YAML (per QNN shard or under `qnn:`):
  calibration:
    prompts: ["...", "..."]   # or
    file: calib.txt           # a text file; default: the text shipped with the package
    samples: 16               # prefill calls; decode calls cover as many tokens (16 x prefill_len)
One more input per method, from text not used for calibration, is kept to measure the shard's SQNR.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from composite.errors import UserError
from composite.manifest import DECODE, PREFILL
from composite.model.default import corpus_text
from composite.runtime.chain import eager_chain

DEFAULT_SAMPLES = 16


def calibration_text(options: dict) -> str:
    if options.get("prompts"):
        return "\n".join(str(p) for p in options["prompts"])
    if options.get("file"):
        try:
            return Path(options["file"]).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"calibration file {options['file']}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UserError(f"calibration file {options['file']} is not UTF-8 text") from None
    return corpus_text()


def token_stream(options: dict, tokenizer, vocab_size: int, length: int) -> list[int]:
    """At least `length` token ids: the calibration text, repeated if short; seeded random ids when
    the export has no tokenizer."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()
    ids = tokenizer.encode(calibration_text(options), bos=False)
    if not ids:
        raise UserError("the calibration text encodes to no tokens")
    ids = [i for i in ids if i < vocab_size]
    return (ids * (length // len(ids) + 1))[:length]


Consumer = Callable[[str, tuple], None]  # (method, inputs) -> None


def calibrate(
    model,
    shard_modules: list,
    consumers: dict[int, Consumer],
    methods: dict[str, int],
    max_seq_len: int,
    options: dict,
    tokenizer,
    bos_id: int | None = None,
    head_decode_from_rows: bool = False,
) -> dict[int, dict[str, tuple]]:
    """Push calibration text through the float chain; each consumer gets every input its shard
    receives, as it arrives (nothing is stored: decode inputs carry whole KV caches). `samples`
    prefill calls are made, and as many decode calls as that covers tokens (samples x prefill
    width), since one decode call sees a single token. Every pass starts a sequence as the runners
    do, with `bos_id` when the export adds one: trained models put their largest activations on a
    sequence's first token. Returns one further input per shard and method, from text the
    consumers never saw, for measuring the lowered shard.

    head_decode_from_rows: a shard of the head alone takes no cache, so its decode input for a
    token is that token's row of a prefill call over the same positions. The decode steps are then
    made as prefill calls (~width times fewer calls of the whole chain) and only such a head's
    consumer gets them: as DECODE inputs (hidden [1, width, dim], arange(width)), the hidden
    states of real tokens only (a padded call's last rows repeat its last real one), so that a
    graph of the head's logits on every row observes exactly the decode steps' values. No
    other shard's decode graph gets anything (composite.tune, whose layer groups stand by their
    prefill graphs)."""
    width = methods[PREFILL]
    prefill_calls = int(options.get("samples", DEFAULT_SAMPLES))
    decode_calls = prefill_calls * width
    chain = eager_chain(model, shard_modules, methods, max_seq_len)
    held_out: dict[int, dict[str, tuple]] = {index: {} for index in consumers}
    holding_out = False
    head_only = {
        m.spec.index for m in shard_modules if m.spec.has_head and not m.spec.has_embedding and not m.spec.layers
    }
    rows_of: int | None = None  # while decode steps run as a prefill call: its real token count

    def observe(index: int, method: str, inputs: list) -> None:
        if index not in consumers:
            return
        if rows_of is not None:
            if index in head_only:
                real_rows = inputs[0][:, torch.arange(width).clamp(max=rows_of - 1)]
                observe_one(index, DECODE, [real_rows, torch.arange(width)])
            return
        observe_one(index, method, inputs)

    def observe_one(index: int, method: str, inputs: list) -> None:
        if holding_out:
            held_out[index].setdefault(method, tuple(t.clone() for t in inputs))
        else:
            consumers[index](method, tuple(inputs))

    chain.input_observer = observe

    # Each pass: prefill chunks over the first half of the cache, then decode steps to its end,
    # so inputs come with caches partly filled, as in real use.
    chunks_per_pass = max(1, min(prefill_calls, (max_seq_len // 2) // width))
    decode_per_pass = max(1, max_seq_len - chunks_per_pass * width - 1)
    passes = max(-(-prefill_calls // chunks_per_pass), -(-decode_calls // decode_per_pass))
    plan = []
    prefill_left, decode_left = prefill_calls, decode_calls
    for _ in range(passes):
        plan.append((min(chunks_per_pass, prefill_left), min(decode_per_pass, decode_left)))
        prefill_left -= plan[-1][0]
        decode_left -= plan[-1][1]
    plan.append((1, 1))  # held out
    stream = token_stream(options, tokenizer, model.args.vocab_size, sum(p * width + d for p, d in plan))
    cursor = 0
    progress = tqdm(
        total=sum(c + d for c, d in plan), desc="calibrating", unit="call", file=sys.stderr, disable=prefill_calls == 0
    )
    for pass_index, (chunks, steps) in enumerate(plan):
        holding_out = pass_index == len(plan) - 1
        chain.reset()
        pos = 0
        for _ in range(chunks):
            chunk = stream[cursor : cursor + width]
            if pos == 0 and bos_id is not None:
                chunk = [bos_id, *chunk[:-1]]
            chain.forward(PREFILL, chunk, pos)
            pos += width
            cursor += width
            progress.update()
        if head_decode_from_rows:
            for start in range(0, steps, width):
                rows_of = min(width, steps - start)
                chain.forward(PREFILL, stream[cursor : cursor + rows_of], pos)
                pos += rows_of
                cursor += rows_of
                progress.update(rows_of)
            rows_of = None
            continue
        for _ in range(steps):
            chain.forward(DECODE, [stream[cursor]], pos)
            pos += 1
            cursor += 1
            progress.update()
    progress.close()
    return held_out


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB."""
    reference, actual = reference.double().flatten(), actual.double().flatten()
    noise = (reference - actual).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))
