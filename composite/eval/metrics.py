"""Quality figures of a model against a reference, with llama.cpp's definitions (its
llama-perplexity --kl-divergence), over the tokens an evaluation scores.

For each scored token t with the reference's distribution p and the tested model's q:
  NLL        -log q(t)                     perplexity = exp(mean NLL)
  KLD        sum_v p(v) (log p(v) - log q(v))
  Δp         q(t) - p(t)                   RMS Δp = sqrt(mean Δp²)
  same top   argmax q == argmax p          top-1 agreement = their share
  PPL ratio  exp(mean(log p(t) - log q(t))) = PPL(tested) / PPL(reference)
When the reference is a kld-base file, p is known on its top k tokens and as the remaining mass:
the KLD sums over those k tokens and one bin for the rest (a lower bound of the exact figure;
composite/eval/kld_base.py says how close it is). runner_cpp/eval.cpp computes the same.
"""

from __future__ import annotations

import math

import torch

# The percentiles reported, as in the JSON keys kld_p50 ... (llama.cpp prints more of them).
PERCENTILES = (50, 90, 99)


class Scores:
    """Per-token figures, added one scored token at a time."""

    def __init__(self):
        self.nll: list[float] = []
        self.kld: list[float] = []
        self.dp: list[float] = []
        self.same_top: list[bool] = []
        self.ref_nll: list[float] = []

    def add(self, logp: torch.Tensor, token: int, reference: Reference | None = None) -> None:
        """logp: the tested model's log-probabilities [vocab] (float64)."""
        self.nll.append(-float(logp[token]))
        if reference is None:
            return
        self.ref_nll.append(-reference.logp_token)
        self.dp.append(math.exp(float(logp[token])) - math.exp(reference.logp_token))
        self.same_top.append(int(torch.argmax(logp)) == reference.top_id)
        self.kld.append(reference.kld(logp))

    def summary(self) -> dict:
        out = {"perplexity": math.exp(sum(self.nll) / len(self.nll)), "tokens": len(self.nll)}
        if self.kld:
            kld = torch.tensor(self.kld, dtype=torch.float64)
            out["kld_mean"] = float(kld.mean())
            for p in PERCENTILES:
                out[f"kld_p{p}"] = percentile(kld, p)
            out["kld_max"] = float(kld.max())
            out["top1_agreement"] = sum(self.same_top) / len(self.same_top)
            out["ppl_ratio"] = math.exp((sum(self.nll) - sum(self.ref_nll)) / len(self.nll))
            out["rms_dp"] = math.sqrt(sum(d * d for d in self.dp) / len(self.dp))
        return out


def percentile(values: torch.Tensor, p: float) -> float:
    """The p-th percentile by linear interpolation between closest ranks (numpy's default)."""
    ordered = torch.sort(values).values
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


class Reference:
    """The reference distribution at one scored position: the full one, or its top k tokens with
    one bin for the remaining mass (from a kld-base file)."""

    def __init__(self, logp_token: float, top_id: int, ids: torch.Tensor, logps: torch.Tensor, logp_rest: float | None):
        """ids/logps: the tokens the reference's distribution is known on and their log-probs
        (all tokens, or the top k); logp_rest: log of the mass outside them (None: all known)."""
        self.logp_token, self.top_id = logp_token, top_id
        self.ids, self.logps, self.logp_rest = ids, logps, logp_rest

    @classmethod
    def full(cls, logp: torch.Tensor, token: int) -> Reference:
        return cls(float(logp[token]), int(torch.argmax(logp)), None, logp, None)

    def kld(self, logq: torch.Tensor) -> float:
        if self.ids is None:
            p = torch.exp(self.logps)
            return float(torch.sum(p * (self.logps - logq)))
        q_known = logq[self.ids]
        total = float(torch.sum(torch.exp(self.logps) * (self.logps - q_known)))
        if self.logp_rest is not None and self.logp_rest > -math.inf:
            q_rest = max(1.0 - float(torch.sum(torch.exp(q_known))), 1e-30)
            total += math.exp(self.logp_rest) * (self.logp_rest - math.log(q_rest))
        return total
