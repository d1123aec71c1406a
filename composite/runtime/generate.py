"""Prefill the prompt in chunks of the prefill method, then decode one token per call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from composite.errors import UserError
from composite.manifest import DECODE, PREFILL, memory_figures
from composite.runtime.speculate import Tree, accepted_path

# Both runners' default (runner_cpp/main.cpp says the same).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids
    # position p -> logits predicting the token at p + 1: the last of each prefill chunk, then
    # every decode step (the reference has every position)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_token_seconds: float = 0.0
    stop_reason: str = ""
    decode_calls: int = 0  # calls after the first token: decode, and verify with a guesser
    verify_calls: int = 0
    accepted: int = 0  # guesses accepted by the verify calls
    # per shard, ms per prompt token (prefill) and per decode call; KV-cache writes likewise
    prefill_shard_ms_per_token: list[float] = field(default_factory=list)
    decode_shard_ms_per_token: list[float] = field(default_factory=list)
    prefill_kv_write_ms_per_token: float = 0.0
    decode_kv_write_ms_per_token: float = 0.0
    in_cache: int = 0  # tokens in the cache after the last one run (the last token is not yet in it)
    context_shifts: int = 0
    context_shift_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decoded(self) -> int:
        """Tokens given out after the first (which the prompt's last call gives)."""
        return max(0, len(self.tokens) - 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded / self.decode_seconds if self.decode_calls and self.decode_seconds else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.decoded / self.decode_calls if self.decode_calls else 0.0


def check_lengths(
    prompt: list[int], max_new_tokens: int, seq_len: int, max_seq_len: int, in_cache: int = 0, shift=None
) -> None:
    """in_cache: tokens already in the cache before the prompt. seq_len 0: no limit (a context
    shift makes room past max_seq_len); shift: the ContextShift, or None to stop at the wall."""
    if not prompt:
        raise UserError("the prompt is empty")
    if shift is None and seq_len > max_seq_len:
        raise UserError(f"--seq-len {seq_len} is beyond this export's max_seq_len {max_seq_len}")
    if shift is not None:
        shift.check_prompt(len(prompt))
    if seq_len and in_cache + len(prompt) >= seq_len:
        raise UserError(
            f"the prompt has {in_cache + len(prompt)} tokens but the sequence limit is {seq_len} "
            f"(max_seq_len {max_seq_len}): nothing left to generate"
        )
    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")


def stop_reason(token: int, generated: int, total: int, limits: Limits) -> str | None:
    """Why generation ends after emitting `token` (the `generated`-th new one, `total` tokens in all
    with the prompt), or None to go on. seq_len counts every token, prompt included."""
    if token in limits.eos_ids:
        return "eos"
    if generated >= limits.max_new_tokens:
        return "max_new_tokens"
    if limits.seq_len and total >= limits.seq_len:
        return "max_seq_len" if limits.seq_len == limits.max_seq_len else "seq_len"
    return None


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int
    seq_len: int  # tokens in all, prompt included; 0: no limit
    max_seq_len: int
    eos_ids: tuple = ()

    def check(self, prompt: list[int]) -> None:
        check_lengths(prompt, self.max_new_tokens, self.seq_len, self.max_seq_len)


def default_seq_len(seq_len: int | None, max_seq_len: int, shift) -> int:
    """--seq-len's default: the export's context without a context shift, no limit with one."""
    return seq_len or (0 if shift is not None else max_seq_len)


def run_call(chain, shift, method: str, tokens: list[int], pos: int) -> tuple[torch.Tensor, int]:
    """One call of `method` at position pos, after a context shift if the cache has no room for it;
    -> (logits of the last token, the position the call ran at)."""
    if shift is not None:
        pos = shift.room(chain.cache, pos, len(tokens))
    return chain.forward(method, tokens, pos), pos


def prefill(
    chain, prompt: list[int], keep_logits: bool, generation: Generation, start_pos: int = 0, shift=None
) -> tuple[torch.Tensor, int]:
    """-> (logits of the prompt's last token, the position after it)."""
    width = chain.methods[PREFILL]
    last, pos = None, start_pos
    for start in range(0, len(prompt), width):
        chunk = prompt[start : start + width]
        # A lone trailing token is cheaper through decode than padded through prefill.
        last, pos = run_call(chain, shift, DECODE if len(chunk) == 1 else PREFILL, chunk, pos)
        pos += len(chunk)
        if keep_logits:
            generation.logits[pos - 1] = last.clone()
    return last, pos


def generate(
    chain,
    prompt: list[int],
    max_new_tokens: int,
    sampler,
    eos_ids=(),
    keep_logits=False,
    on_token=None,
    seq_len: int | None = None,
    start_pos: int = 0,
    shift=None,
    guesser=None,
) -> Generation:
    """seq_len: tokens in all, prompt included (default: the export's max_seq_len without a shift,
    no limit with one). start_pos: the cache already holds that many tokens before the prompt (a
    chat's later turns); 0 starts afresh. shift: a ContextShift, or None to stop at max_seq_len.
    guesser: runtime/speculate.py's PromptLookup or Lookahead, checked by the verify method (greedy
    only), or None to decode a token per call."""
    limits = Limits(
        max_new_tokens, default_seq_len(seq_len, chain.max_seq_len, shift), chain.max_seq_len, tuple(eos_ids)
    )
    check_lengths(prompt, max_new_tokens, limits.seq_len, limits.max_seq_len, in_cache=start_pos, shift=shift)
    if start_pos == 0:
        chain.reset()
    chain.reset_stats()
    shifts_before, shift_seconds_before = (shift.shifts, shift.seconds) if shift is not None else (0, 0.0)
    generation = Generation(list(prompt))
    history = guesser.begin(prompt, start_pos) if guesser is not None else None
    started = time.perf_counter()
    logits, pos = prefill(chain, prompt, keep_logits, generation, start_pos, shift)
    token = sampler(logits)
    generation.prefill_seconds = generation.first_token_seconds = time.perf_counter() - started
    generation.prefill_shard_ms_per_token = [s * 1e3 / len(prompt) for s in chain.shard_seconds]
    generation.prefill_kv_write_ms_per_token = chain.kv_write_seconds * 1e3 / len(prompt)
    chain.reset_stats()
    total = start_pos + len(prompt)  # tokens so far, the evicted ones included

    def emit(token: int) -> bool:
        """Gives out one generated token; True when generation ends with it."""
        nonlocal total
        total += 1
        generation.tokens.append(token)
        if history is not None:  # the guesser's text; plain decode keeps none
            history.append(token)
        if on_token is not None:
            on_token(token)
        generation.stop_reason = stop_reason(token, len(generation.tokens), total, limits)
        return bool(generation.stop_reason)

    decode_started = time.perf_counter()
    done = emit(token)
    while not done:
        tree = guesses(guesser, history, pos, len(generation.tokens), limits, shift)
        if tree is None:
            logits, pos = run_call(chain, shift, DECODE, [token], pos)
            generation.decode_calls += 1
            if keep_logits:
                generation.logits[pos] = logits.clone()
            token = sampler(logits)
            pos += 1
            done = emit(token)
            continue
        token, pos, done = verify_step(chain, shift, guesser, tree, pos, generation, emit, keep_logits)
    generation.decode_seconds = time.perf_counter() - decode_started
    generation.in_cache = pos
    if shift is not None:
        generation.context_shifts = shift.shifts - shifts_before
        generation.context_shift_seconds = shift.seconds - shift_seconds_before
    calls = generation.decode_calls
    generation.decode_shard_ms_per_token = [s * 1e3 / calls if calls else 0.0 for s in chain.shard_seconds]
    generation.decode_kv_write_ms_per_token = chain.kv_write_seconds * 1e3 / calls if calls else 0.0
    return generation


def verify_step(chain, shift, guesser, tree: Tree, pos: int, generation: Generation, emit, keep_logits: bool):
    """One verify call on `tree` at pos: its accepted tokens given out by emit (which says when
    generation ends), the accepted path's entries committed to the cache. -> (the next token to
    run, its position, whether generation ended)."""
    if shift is not None:
        pos = shift.room(chain.cache, pos, max(tree.depths) + 1)
    rows = chain.forward_tree(tree.tokens, tree.parents, pos)
    generation.decode_calls += 1
    generation.verify_calls += 1
    choices = rows.argmax(-1).tolist()
    path, ahead = accepted_path(tree, choices)
    guesser.learn(tree, choices)
    generation.accepted += len(path) - 1
    emitted, done = 0, False
    for guess in ahead[:-1]:
        emitted += 1
        if emit(guess):
            done = True
            break
    kept = path[:emitted] if done else path  # the last token given out is not yet in the cache
    chain.commit(kept, pos)
    if keep_logits:
        for i, row in enumerate(kept):
            generation.logits[pos + i] = rows[row].clone()
    pos += len(kept)
    token = ahead[-1]
    return token, pos, done or emit(token)


def guesses(guesser, history: list[int], pos: int, generated: int, limits: Limits, shift) -> Tree | None:
    """The tree of the next verify call (its root the last token of history, at pos), cut to what
    can still be used: no deeper than the tokens left to generate and, without a context shift,
    than the cache; None where nothing is left to check (a decode call instead)."""
    tree = guesser.tree(history) if guesser is not None else None
    if tree is None:
        return None
    depth = limits.max_new_tokens - generated - 1
    if shift is None:
        depth = min(depth, limits.max_seq_len - 1 - pos)
    if max(tree.depths) > depth:
        tree = tree.cut(depth)
    return tree if len(tree.tokens) > 1 else None


def stats(generation: Generation, manifest: dict, runner: str, **run_info) -> dict:
    """The stats document both runners write (composite_runner --stats_json, composite.run
    --stats-json/--json; keys listed in docs/usage.md, "Stats"). run_info: load_ms, threads, seed,
    peak_rss_mb, qnn_simulator, and anything the runner adds."""
    return {
        "runner": runner,
        "tokens": generation.tokens,
        "prompt_tokens": len(generation.prompt),
        "stop_reason": generation.stop_reason,
        "time_to_first_token_ms": generation.first_token_seconds * 1e3,
        "prefill_tokens_per_s": generation.prefill_tokens_per_s,
        "decode_tokens_per_s": generation.decode_tokens_per_s,
        "tokens_per_call": generation.tokens_per_call,
        "verify_calls": generation.verify_calls,
        "accepted_per_call": generation.accepted / generation.verify_calls if generation.verify_calls else 0.0,
        "shard_ms_per_token": generation.decode_shard_ms_per_token,
        "kv_write_ms_per_token": generation.decode_kv_write_ms_per_token,
        "prefill_shard_ms_per_token": generation.prefill_shard_ms_per_token,
        "prefill_kv_write_ms_per_token": generation.prefill_kv_write_ms_per_token,
        "prefill_width": manifest["methods"][PREFILL],
        "context_shifts": generation.context_shifts,
        "context_shift_ms": generation.context_shift_seconds * 1e3,
        "shard_backends": [(s.get("backends") or ["portable"])[0] for s in manifest["shards"]],
        "shard_layers": [shard_label(s) for s in manifest["shards"]],
        **memory_figures(manifest),
        **run_info,
    }


def shard_label(shard: dict) -> str:
    """ "emb+L0-L2", "L3-L5+head": what a shard holds (composite_runner labels shards the same way)."""
    first, end = shard["layers"]
    parts = (["emb"] if shard["has_embedding"] else []) + ([f"L{first}-L{end - 1}"] if end > first else [])
    return "+".join(parts + (["head"] if shard["has_head"] else []))
