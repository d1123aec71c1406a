"""Next-token choice: greedy at temperature 0, else temperature + top-p, seeded."""

from __future__ import annotations

import secrets

import torch


def fresh_seed() -> int:
    """A seed for a run that was given none (both runners default to one, and print it)."""
    return secrets.randbits(63)


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [vocab] -> token id."""
        if self.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.double() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
