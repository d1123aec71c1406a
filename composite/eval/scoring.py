"""What an evaluation scores, and the models it scores: text cut into chunks as llama.cpp's
llama-perplexity cuts it, and log-probabilities at every position of a chunk from an export (its
shards, one decode call per token, as a runner would) or from the float model in PyTorch.

Chunks: the text's tokens (the first --limit-tokens of them) in non-overlapping runs of ctx
tokens; a remainder shorter than ctx is left out; when the export adds BOS, it replaces each
chunk's first token (llama.cpp does the same). Each chunk starts from an empty cache.
Scored: the tokens at positions 1 .. ctx-1 of a chunk, each predicted from the positions before it
("all"), or only those after the first half, positions ctx/2 + 1 .. ctx-1 ("second-half", llama.cpp's
choice, so that every scored token has at least half a context before it).
runner_cpp/eval.cpp cuts and scores the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from composite.errors import UserError
from composite.manifest import DECODE

SCORE_MODES = ("all", "second-half")


def read_text(path: str) -> str:
    """The file's text as it is (no newline translation: composite_runner reads the bytes)."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"text {path} does not exist") from None
    except UnicodeDecodeError:
        raise UserError(f"text {path} is not UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read text {path}: {e.strerror}") from None


def eval_tokens(tokenizer, text: str, limit: int | None) -> list[int]:
    if not text.strip():
        raise UserError("the evaluation text is empty")
    ids = tokenizer.encode(text, bos=False, parse_special=False)
    return ids[:limit] if limit else ids


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    if ctx < 2:
        raise UserError(f"--ctx must be at least 2, got {ctx}")
    if len(ids) < 2:
        raise UserError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed")
    count = len(ids) // ctx
    if count == 0:
        raise UserError(f"the evaluation text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}: lower --ctx")
    out = []
    for i in range(count):
        chunk = ids[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def first_scored(ctx: int, mode: str) -> int:
    """The position of a chunk's first scored token (the logits before it predict it)."""
    return 1 if mode == "all" else ctx // 2 + 1


class ExportModel:
    """An export's shards, fed one token per decode call: the logits of every position."""

    def __init__(self, chain):
        self.chain = chain
        self.seconds = 0.0
        self.tokens = 0

    def logits(self, chunk: list[int]):
        """Yields (position, log-probabilities [vocab] in float64) for positions 0 .. len-2."""
        self.chain.reset()
        for position, token in enumerate(chunk[:-1]):
            started = time.perf_counter()
            logits = self.chain.forward(DECODE, [token], position)
            self.seconds += time.perf_counter() - started
            self.tokens += 1
            yield position, torch.log_softmax(logits.double(), dim=-1)


class EagerModel:
    """The float model in PyTorch, a whole chunk at once."""

    def __init__(self, model):
        self.model = model
        self.seconds = 0.0
        self.tokens = 0

    def logits(self, chunk: list[int]):
        started = time.perf_counter()
        with torch.no_grad():
            full = self.model.forward_full(torch.tensor([chunk]))[0]
        self.seconds += time.perf_counter() - started
        self.tokens += len(chunk) - 1
        for position in range(len(chunk) - 1):
            yield position, torch.log_softmax(full[position].double(), dim=-1)
