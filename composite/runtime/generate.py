"""Prefill the prompt in chunks of the prefill method, then decode one token per call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from composite.errors import UserError
from composite.manifest import DECODE, PREFILL

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


def check_lengths(prompt: list[int], max_new_tokens: int, seq_len: int, max_seq_len: int) -> None:
    if not prompt:
        raise UserError("the prompt is empty")
    if seq_len > max_seq_len:
        raise UserError(f"--seq-len {seq_len} is beyond this export's max_seq_len {max_seq_len}")
    if len(prompt) >= seq_len:
        raise UserError(
            f"the prompt has {len(prompt)} tokens but the sequence limit is {seq_len} "
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
    if total >= limits.seq_len:
        return "max_seq_len" if limits.seq_len == limits.max_seq_len else "seq_len"
    return None


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int
    seq_len: int
    max_seq_len: int
    eos_ids: tuple = ()

    def check(self, prompt: list[int]) -> None:
        check_lengths(prompt, self.max_new_tokens, self.seq_len, self.max_seq_len)


def prefill(chain, prompt: list[int], keep_logits: bool, generation: Generation) -> torch.Tensor:
    width = chain.methods[PREFILL]
    last = None
    for start in range(0, len(prompt), width):
        chunk = prompt[start : start + width]
        # A lone trailing token is cheaper through decode than padded through prefill.
        method = DECODE if len(chunk) == 1 else PREFILL
        last = chain.forward(method, chunk, start)
        if keep_logits:
            generation.logits[start + len(chunk) - 1] = last.clone()
    return last


def generate(
    chain,
    prompt: list[int],
    max_new_tokens: int,
    sampler,
    eos_ids=(),
    keep_logits=False,
    on_token=None,
    seq_len: int | None = None,
) -> Generation:
    """seq_len: tokens in all, prompt included (default: the export's max_seq_len)."""
    limits = Limits(max_new_tokens, seq_len or chain.max_seq_len, chain.max_seq_len, tuple(eos_ids))
    limits.check(prompt)
    chain.reset()
    generation = Generation(list(prompt))
    started = time.perf_counter()
    logits = prefill(chain, prompt, keep_logits, generation)
    token = sampler(logits)
    generation.prefill_seconds = generation.first_token_seconds = time.perf_counter() - started
    pos = len(prompt)
    decode_started = time.perf_counter()
    while True:
        generation.tokens.append(token)
        if on_token is not None:
            on_token(token)
        generation.stop_reason = stop_reason(token, len(generation.tokens), pos + 1, limits)
        if generation.stop_reason:
            break
        logits = chain.forward(DECODE, [token], pos)
        if keep_logits:
            generation.logits[pos] = logits.clone()
        token = sampler(logits)
        pos += 1
    generation.decode_seconds = time.perf_counter() - decode_started
    return generation
