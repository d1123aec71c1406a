"""Calibration inputs for quantized shards, captured from the float model itself.

A shard in the middle of the model sees hidden states, positions, masks and KV caches, not text.
The float shards are chained exactly as the runners chain the exported ones (runtime/chain.py),
text is pushed through them (prefill chunks, then teacher-forced decode steps, so caches are
partly filled as in real use) and the inputs each quantized shard receives are recorded per method.

YAML (per QNN shard or under `qnn:`):
  calibration:
    prompts: ["...", "..."]   # or
    file: calib.txt           # a text file; default: the text shipped with the package
    samples: 16               # prefill calls (default 16, 128 where a shard has 16a4w_block weights)
    decode_samples: 16        # decode calls cover as many prefill calls' tokens (16 x prefill_len;
                              # default: samples, at most 16)
One more input per method, from text not used for calibration, is kept to measure the shard's SQNR.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from composite import manifest as manifest_schema
from composite.errors import UserError
from composite.manifest import DECODE, PREFILL, VERIFY, takes_logits_index
from composite.model.default import corpus_text
from composite.model.llama import cache_shapes
from composite.runtime.kv_cache import AttentionMask, KVCache
from composite.runtime.shard_call import call_inputs, last_row, padded_tokens, write_new_entries

DEFAULT_SAMPLES = 16
# decode calls cover at most this many prefill calls' tokens, unless decode_samples says: a
# decode call reads all of a shard's weights for one token, and the ranges they observe settle
# long before more prefill tokens stop adding to GPTQ's statistics (weight_rounding.py)
DEFAULT_DECODE_SAMPLES = 16
BLOCK_SAMPLES = 128  # prefill calls for shards with 16a4w_block weights (more tokens for GPTQ)


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


def effective_options(placements: list, index: int) -> dict:
    """The calibration settings QNN shard `index` is calibrated and measured with: its own, and
    no samples where every QNN shard that shares them is fp16 (those need only the held-out input,
    to measure SQNR), BLOCK_SAMPLES where one of them has block-wise 4-bit weights (GPTQ rounds
    them by the inputs' statistics) and its settings name none. Shards with the same effective
    settings share one calibration run."""
    own = placements[index].options.get("calibration") or {}
    sharing = [p for p in placements if p.backend == "qnn" and (p.options.get("calibration") or {}) == own]
    if all(p.options["precision"] == "fp16" for p in sharing):
        return {**own, "samples": 0}
    if "samples" not in own and any(has_block_weights(p.options) for p in sharing):
        return {**own, "samples": BLOCK_SAMPLES}
    return dict(own)


def has_block_weights(options: dict) -> bool:
    """A QNN placement's options with 16a4w_block weights rounded by GPTQ (for the shard or an override)."""
    precisions = (options["precision"], *(options.get("overrides") or {}).values())
    return "16a4w_block" in precisions and options.get("rounding") == "gptq"


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


@dataclass(frozen=True)
class Call:
    """One call of every shard's `method` in a calibration run, as a runner makes it."""

    method: str
    tokens: tuple[int, ...]  # the real tokens (at most the method's width; the rest is padding)
    pos: int  # position of the first
    starts_sequence: bool  # caches are cleared before it
    held_out: bool  # from text calibration never sees: the input that measures a lowered shard
    rows: int | None = None  # decode steps made as one prefill call of this many tokens (see calibrate)


def calibration_calls(
    options: dict,
    tokenizer,
    vocab_size: int,
    methods: dict[str, int],
    max_seq_len: int,
    bos_id: int | None = None,
    head_decode_from_rows: bool = False,
) -> list[Call]:
    """The calls of a calibration run: `samples` prefill calls and decode calls covering as many
    tokens as `decode_samples` of them (x prefill width), since one decode call sees a single token. Each pass
    starts a sequence as the runners do, with `bos_id` when the export adds one (trained models
    put their largest activations on a sequence's first token), prefills over the first half of
    the cache, then decodes to its end, so inputs come with caches partly filled, as in real use;
    the first pass decodes from the sequence's start instead (below). A last pass (one prefill,
    one decode call) is held out."""
    width = methods[PREFILL]
    verify = methods.get(VERIFY, 0)
    prefill_calls = int(options.get("samples", DEFAULT_SAMPLES))
    decode_calls = int(options.get("decode_samples", min(prefill_calls, DEFAULT_DECODE_SAMPLES))) * width
    chunks_per_pass = max(1, min(prefill_calls, (max_seq_len // 2) // width))
    decode_per_pass = max(1, max_seq_len - chunks_per_pass * width - 1)
    passes = max(-(-prefill_calls // chunks_per_pass), -(-decode_calls // decode_per_pass))
    # The first pass decodes a sequence from its start, as composite.eval and --eval_text call a
    # shard (a decode call per token): the first position's activations (a trained model's largest,
    # on its BOS) are then in the decode method's ranges too, which prefill passes alone never give it.
    opening = min(width, decode_calls)
    plan = [(0, opening)] if opening else []
    prefill_left, decode_left = prefill_calls, decode_calls - opening
    for _ in range(passes):
        plan.append((min(chunks_per_pass, prefill_left), min(decode_per_pass, decode_left)))
        prefill_left -= plan[-1][0]
        decode_left -= plan[-1][1]
    plan = [entry for entry in plan if entry != (0, 0)]
    plan.append((1, 1))  # held out
    # (the stream's last `verify` tokens only ever feed the held-out verify call)
    stream = token_stream(options, tokenizer, vocab_size, sum(p * width + d for p, d in plan) + verify)
    calls, cursor = [], 0
    for pass_index, (chunks, steps) in enumerate(plan):
        held_out = pass_index == len(plan) - 1
        pos = 0
        for _ in range(chunks):
            chunk = stream[cursor : cursor + width]
            if pos == 0 and bos_id is not None:
                chunk = [bos_id, *chunk[:-1]]
            calls.append(Call(PREFILL, tuple(chunk), pos, pos == 0, held_out))
            pos += width
            cursor += width
        if chunks and verify and pos + verify <= max_seq_len:
            # A verify call after the prompt, its tokens a chain (as prompt lookup's guesses are):
            # the tokens the decode steps then take one by one at the same positions, overwriting
            # its cache entries before any call sees them; the other calls are as without it.
            calls.append(Call(VERIFY, tuple(stream[cursor : cursor + verify]), pos, False, held_out))
        if head_decode_from_rows:
            for start in range(0, steps, width):
                rows = min(width, steps - start)
                tokens = stream[cursor : cursor + rows]
                if pos == 0 and bos_id is not None:  # as the decode steps below: the BOS in the first token's place
                    tokens = [bos_id, *tokens[1:]]
                calls.append(Call(PREFILL, tuple(tokens), pos, pos == 0, held_out, rows))
                pos += rows
                cursor += rows
            continue
        for _ in range(steps):
            token = bos_id if pos == 0 and bos_id is not None else stream[cursor]
            calls.append(Call(DECODE, (token,), pos, pos == 0, held_out))
            pos += 1
            cursor += 1
    return calls


class ShardReplay:
    """A float shard called as the runners call it (runtime/shard_call.py, as runtime/chain.py
    calls each shard): the same padded tokens or hidden state, positions, mask, its own layers' KV
    cache (cleared where a sequence starts, new entries written after each call) and logits row."""

    def __init__(self, module, methods: dict[str, int], max_seq_len: int):
        self.module, self.methods, self.spec = module, dict(methods), module.spec
        self.cache = KVCache(len(module.spec.layers), *cache_shapes(module.args, max_seq_len))
        self.masks = {name: AttentionMask(n, max_seq_len, manifest_schema.MASK_HIDDEN) for name, n in methods.items()}

    def inputs(self, call: Call, x) -> list:
        """The shard's inputs for `call`; x: the previous shard's output (None for the embedding)."""
        width = self.methods[call.method]
        if self.spec.has_embedding:
            x = padded_tokens(call.tokens, width)
        if call.starts_sequence:
            self.cache.reset()
        caches = list(zip(self.cache.k, self.cache.v))
        row = last_row(len(call.tokens)) if self.spec.has_head and takes_logits_index(call.method, width) else None
        return call_inputs(x, call.pos, width, self.masks[call.method].at(call.pos), caches, row)

    def run(self, call: Call, inputs: list, graph=None) -> list:
        """The shard (or `graph`, a form of it with the same inputs and outputs) called on
        `inputs`; its new cache entries are written."""
        with torch.no_grad():
            outputs = list((graph or self.module)(*inputs))
        write_new_entries(self.cache, range(len(self.spec.layers)), outputs, call.pos, len(call.tokens))
        return outputs


def replay(
    module,
    calls: list[Call],
    stream: list | None,
    methods: dict[str, int],
    max_seq_len: int,
    observe: Callable[[Call, list], None] | None = None,
    keep_outputs: bool = True,
    progress=None,
) -> list | None:
    """Runs the float shard `module` over `calls`, its input for each being the previous shard's
    output in `stream` (None for the embedding shard: the calls' tokens); observe(call, inputs)
    sees every input before the shard runs. -> the shard's main output per call (the next shard's
    stream), or None with keep_outputs false."""
    shard = ShardReplay(module, methods, max_seq_len)
    outputs = [] if keep_outputs else None
    for i, call in enumerate(calls):
        inputs = shard.inputs(call, None if stream is None else stream[i])
        if observe is not None:
            observe(call, inputs)
        result = shard.run(call, inputs)
        if keep_outputs:
            outputs.append(result[0])
        if progress is not None:
            progress.update()
    return outputs


def replay_wide(module, calls: list[Call], stream: list | None, methods: dict[str, int], max_seq_len: int) -> list:
    """replay() for the float chain that feeds QNN shards their calibration inputs: each run of
    decode steps in one sequence is made as prefill calls of up to prefill_len tokens (one read of
    the shard's weights per call, not per token: the float chain of a 3B model reads 2 GB a call).
    A decode step's output is its token's row of such a call: the same arithmetic, in a matmul
    of more rows. -> the shard's main output per call of `calls` ([1, 1, dim] for a decode step)."""
    if module.spec.has_head:
        raise ValueError("replay_wide makes the hidden states a later shard takes; the head gives none")
    shard = ShardReplay(module, methods, max_seq_len)
    width = methods[PREFILL]
    outputs: list = [None] * len(calls)
    start = 0
    while start < len(calls):
        first = calls[start]
        end = start + 1
        if first.method == DECODE:
            while (
                end < len(calls)
                and end - start < width
                and calls[end].method == DECODE
                and not calls[end].starts_sequence
                and calls[end].held_out == first.held_out
                and calls[end].pos == calls[end - 1].pos + 1
            ):
                end += 1
            call = Call(
                PREFILL, tuple(c.tokens[0] for c in calls[start:end]), first.pos, first.starts_sequence, first.held_out
            )
        else:
            call = first
        x = None
        if stream is not None:
            x = torch.cat(stream[start:end], dim=1)
            if call.method == PREFILL and x.shape[1] < width:
                x = torch.cat((x, x.new_zeros(1, width - x.shape[1], x.shape[2])), dim=1)
        result = shard.run(call, shard.inputs(call, x))[0]
        if first.method == DECODE:
            for i in range(start, end):
                outputs[i] = result[:, i - start : i - start + 1].clone()
        else:
            outputs[start] = result
        start = end
    return outputs


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
    """Push calibration text (calibration_calls) through the float shards, one shard at a time
    over all the calls (each shard keeps its own layers' cache), each consumer getting every
    input its shard receives, as it arrives (nothing is stored: decode inputs carry whole KV
    caches). Returns one further input per shard and method, from text the consumers never saw,
    for measuring the lowered shard.

    head_decode_from_rows: a shard of the head alone takes no cache, so its decode input for a
    token is that token's row of a prefill call over the same positions. The decode steps are then
    made as prefill calls (~width times fewer calls of the whole chain) and only such a head's
    consumer gets them: as DECODE inputs (hidden [1, width, dim], arange(width)), the hidden
    states of real tokens only (a padded call's last rows repeat its last real one), so that a
    graph of the head's logits on every row observes exactly the decode steps' values. No
    other shard's decode graph gets anything (composite.tune, whose layer groups stand by their
    prefill graphs)."""
    calls = calibration_calls(
        options, tokenizer, model.args.vocab_size, methods, max_seq_len, bos_id, head_decode_from_rows
    )
    width = methods[PREFILL]
    held_out: dict[int, dict[str, tuple]] = {index: {} for index in consumers}
    last = max((i for i, m in enumerate(shard_modules) if m.spec.index in consumers), default=-1)
    progress = tqdm(
        total=len(calls) * (last + 1),
        desc="calibrating",
        unit="call",
        file=sys.stderr,
        disable=int(options.get("samples", DEFAULT_SAMPLES)) == 0,
    )

    def observer(index: int, head_only: bool):
        def observe(call: Call, inputs: list) -> None:
            if call.rows is not None:
                if head_only:
                    real_rows = inputs[0][:, torch.arange(width).clamp(max=call.rows - 1)]
                    observe_one(call, DECODE, [real_rows, torch.arange(width)])
                return
            observe_one(call, call.method, inputs)

        def observe_one(call: Call, method: str, inputs: list) -> None:
            if call.held_out:
                held_out[index].setdefault(method, tuple(t.clone() for t in inputs))
            else:
                consumers[index](method, tuple(inputs))

        return observe

    stream = None
    for module in shard_modules[: last + 1]:
        spec = module.spec
        head_only = spec.has_head and not spec.has_embedding and not spec.layers
        observe = observer(spec.index, head_only) if spec.index in consumers else None
        stream = replay(module, calls, stream, methods, max_seq_len, observe, progress=progress)
    progress.close()
    return held_out


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB."""
    reference, actual = reference.double().flatten(), actual.double().flatten()
    noise = (reference - actual).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))
