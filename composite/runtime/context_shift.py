"""Context shift: a generation, a chat or a scored text goes on past the export's max_seq_len.

When a call needs more cache slots than are left, the first `keep` tokens stay where they are (the
attention sinks of StreamingLLM: the model keeps attending to the first tokens whatever they say),
the oldest `evict` tokens after them leave in one batch, and the rest move down by `evict` slots.
The cache holds keys after RoPE, so each moved key is rotated back by `evict` positions: a key
computed at position p and rotated by -evict is the key the model computes at p - evict (the same
rotation, up to rounding). Positions therefore stay below max_seq_len, which the export was built
and calibrated for (QNN shards look RoPE up in a table of max_seq_len positions), and the mask,
which shows the slots below the call's first position, needs nothing new.

Quantized caches (QNN shards' uint8/uint16, XNNPACK's float16) are decoded, rotated in float32
and encoded again with the layer's own encoding. runner_cpp/kv_cache.cpp shifts the same way,
with the same float32 arithmetic.
"""

from __future__ import annotations

import time

import torch

from composite.errors import UserError
from composite.runtime.threads import one_thread

DEFAULT_KEEP = 4  # StreamingLLM's sink count


def default_evict(window: int, keep: int) -> int:
    """Slots freed per shift when --evict is not given: a quarter of what can be evicted, so a shift
    (a pass over the cache) comes once every window/4 tokens (docs/quality.md, "Past the context")."""
    return max(1, (window - keep) // 4)


class ContextShift:
    """keep/evict as the user set them, checked against the export; room() makes space in a cache."""

    def __init__(self, manifest: dict, keep: int | None = None, evict: int | None = None):
        self.window = manifest["max_seq_len"]
        self.keep = DEFAULT_KEEP if keep is None else keep
        # Room for a prompt token and a generated one; a prefill call narrower than its method
        # fits wherever the prompt does (check_prompt).
        if not 0 <= self.keep <= self.window - 2:
            raise UserError(
                f"--keep {self.keep} leaves no room in the context of {self.window} tokens "
                f"(keep must be 0 .. {self.window - 2})"
            )
        self.evict = default_evict(self.window, self.keep) if evict is None else evict
        if not 1 <= self.evict <= self.window - self.keep:
            raise UserError(
                f"--evict {self.evict} is out of range: 1 .. {self.window - self.keep} tokens can be evicted past the "
                f"{self.keep} kept of {self.window}"
            )
        rope = manifest.get("rope")
        if rope is None:
            raise UserError(
                "this export's manifest has no 'rope' entry (it predates context shift): export it again, or pass "
                "--no-context-shift"
            )
        self.inv_freq = torch.tensor(rope["inv_freq"], dtype=torch.float32)
        self.shifts = 0
        self.seconds = 0.0

    def fits(self, prompt_tokens: int) -> bool:
        """A prompt fits in the context beside the kept tokens, with a slot left to generate."""
        return self.keep + prompt_tokens < self.window

    def too_long(self, what: str, tokens: int) -> str:
        return (
            f"{what} has {tokens} tokens, more than the context holds: max_seq_len {self.window} less {self.keep} "
            f"kept (--keep) leaves room for {self.window - self.keep - 1}"
        )

    def check_prompt(self, prompt_tokens: int) -> None:
        if not self.fits(prompt_tokens):
            raise UserError(self.too_long("the prompt", prompt_tokens))

    def room(self, cache, used: int, needed: int) -> int:
        """Makes room for `needed` more tokens after the `used` slots of `cache`; returns the slots
        used after it (where the next token goes)."""
        if used + needed <= self.window:
            return used
        evict = max(self.evict, used + needed - self.window)
        if evict > used - self.keep:
            raise UserError(
                f"cannot make room for {needed} tokens: only {used - self.keep} of the {used} in the context can be "
                f"evicted past the {self.keep} kept"
            )
        started = time.perf_counter()
        cos, sin = rotation_by(self.inv_freq, -evict)
        with one_thread():  # ExecuTorch's threadpool holds the cores (docs/quality.md)
            cache.shift(self.keep, evict, used, cos, sin)
        self.seconds += time.perf_counter() - started
        self.shifts += 1
        return used - evict


def rotation_by(inv_freq: torch.Tensor, distance: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [head_dim/2] (float32) of RoPE's rotation by `distance` positions, from the angle
    in float64 (runner_cpp computes the same)."""
    angles = float(distance) * inv_freq.to(torch.float64)
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """keys [kv_heads, head_dim, n] (float32, rotate-half pairs i and i + head_dim/2) rotated by
    the angle whose cos/sin [head_dim/2] are given."""
    half = keys.shape[1] // 2
    x1, x2 = keys[:, :half], keys[:, half:]
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=1)


def add_flags(parser) -> None:
    """--keep, --evict and --no-context-shift, as composite.run and composite.eval take them
    (composite_runner spells them --keep, --evict, --no_context_shift)."""
    parser.add_argument(
        "--keep",
        type=int,
        help=f"past the context, keep the first N tokens, the attention sinks (default {DEFAULT_KEEP})",
    )
    parser.add_argument(
        "--evict", type=int, help="past the context, evict N tokens at a time (default: a quarter of the context)"
    )
    parser.add_argument(
        "--no-context-shift",
        "--no_context_shift",
        action="store_true",
        help="stop at the export's max_seq_len instead of evicting the oldest tokens",
    )


def from_flags(args, manifest: dict) -> ContextShift | None:
    if args.no_context_shift:
        if args.keep is not None or args.evict is not None:
            raise UserError("--keep and --evict shape the context shift: drop them or --no-context-shift")
        return None
    return ContextShift(manifest, args.keep, args.evict)
