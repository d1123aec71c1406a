"""composite.eval --stream: a text many times longer than the export's context, scored token by
token through the runner's shifting cache (composite/runtime/context_shift.py), the way a long
chat or generation sees it. composite_runner --eval_text FILE --stream scores the same way.

Every token of the text after the first is scored (BOS in place of the first when the export adds
one), each predicted from what the cache still holds: all of it until the context fills, then the
`keep` first tokens and the most recent ones. With --reference eager the float model scores the
same tokens twice: (a) with the whole text before each token (full context) and (b) with the
max_seq_len tokens before it, recomputed from scratch for every token (a sliding window,
StreamingLLM's strong baseline); the KLD and the other figures are against (b), the float model
seeing as many tokens as the export can.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from tqdm import tqdm

from composite.errors import UserError
from composite.eval.metrics import Reference, Scores
from composite.manifest import DECODE
from composite.runtime.generate import run_call


def stream_ids(ids: list[int], bos: int | None) -> list[int]:
    if len(ids) < 2:
        raise UserError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed")
    return [bos, *ids[1:]] if bos is not None else list(ids)


def export_logits(chain, ids: list[int], shift):
    """Yields log-probabilities [vocab] (float64) after each of ids[:-1], one decode call each;
    without a shift, only as many as the context holds."""
    chain.reset()
    pos = 0
    count = len(ids) - 1 if shift is not None else min(len(ids) - 1, chain.max_seq_len)
    for token in ids[:count]:
        logits, pos = run_call(chain, shift, DECODE, [token], pos)
        pos += 1
        yield torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def full_context_nll(model, ids: list[int]) -> list[float]:
    """-log p(ids[i+1] | ids[:i+1]) from the float model seeing the whole text."""
    logp = torch.log_softmax(model.forward_full(torch.tensor([ids]))[0].double(), dim=-1)
    return [-float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


@torch.no_grad()
def window_logits(model, ids: list[int], window: int):
    """Yields the float model's log-probabilities after each of ids[:-1], seeing at most `window`
    tokens ending there, recomputed from scratch; the positions before the window fills come
    from one pass."""
    first = torch.log_softmax(model.forward_full(torch.tensor([ids[:window]]))[0].double(), dim=-1)
    for i in range(min(window, len(ids) - 1)):
        yield first[i]
    for i in range(window, len(ids) - 1):
        yield torch.log_softmax(model.forward_full(torch.tensor([ids[i - window + 1 : i + 1]]))[0, -1].double(), dim=-1)


def evaluate_stream(chain, manifest: dict, ids: list[int], shift, reference_model=None) -> dict:
    ids = stream_ids(ids, manifest.get("bos_id"))
    window = manifest["max_seq_len"]
    references = window_logits(reference_model, ids, window) if reference_model is not None else None
    scores = Scores()
    seconds, count, started = 0.0, 0, time.perf_counter()
    progress = tqdm(
        total=len(ids) - 1, desc="streaming", unit="token", file=sys.stderr, disable=not sys.stderr.isatty()
    )
    for i, logp in enumerate(export_logits(chain, ids, shift)):
        seconds += time.perf_counter() - started
        count += 1
        progress.update()
        token = ids[i + 1]
        scores.add(logp, token, Reference.full(next(references), token) if references is not None else None)
        started = time.perf_counter()
    progress.close()
    result = scores.summary()
    result.update(
        tokens_per_s=count / seconds if seconds else 0.0,
        stream=True,
        ctx=window,
        keep=shift.keep if shift is not None else 0,
        evict=shift.evict if shift is not None else 0,
        context_shifts=shift.shifts if shift is not None else 0,
        context_shift_ms=shift.seconds * 1e3 if shift is not None else 0.0,
    )
    if reference_model is not None:
        result["reference_window_perplexity"] = math.exp(sum(scores.ref_nll) / len(scores.ref_nll))
        full = full_context_nll(reference_model, ids[: count + 1])
        result["reference_full_perplexity"] = math.exp(sum(full) / len(full))
    return result


def report_stream(result: dict) -> None:
    print(
        f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens (streamed through a context of "
        f"{result['ctx']}, keep {result['keep']}, evict {result['evict']}, {result['context_shifts']} shifts), "
        f"{result['tokens_per_s']:.1f} tokens/s"
    )
    if "reference_window_perplexity" in result:
        print(
            f"the float model on the same tokens: perplexity {result['reference_full_perplexity']:.4f} with the whole "
            f"text before each token, {result['reference_window_perplexity']:.4f} with a sliding window of "
            f"{result['ctx']} recomputed per token (PPL ratio to it {result['ppl_ratio']:.4f}, mean KLD "
            f"{result['kld_mean']:.6f}, top-1 agreement {100 * result['top1_agreement']:.2f}%)"
        )
