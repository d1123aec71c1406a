"""The kld-base file: a reference model's token probabilities on an evaluation's scored tokens, so
that another run (composite_runner --eval_text on a phone, or composite.eval later) can measure
KL divergence against them without the reference at hand. llama.cpp's --kl-divergence-base keeps
every vocabulary entry at 16 bits; this keeps each position's top k tokens and the remaining mass
(k = 64 by default; the KLD against it is a lower bound: 88% of the exact figure on SmolLM2-135M
8da4w, so a larger --k where it must be exact; see docs/quality.md). runner_cpp/eval.cpp reads the same format.

Layout, little-endian:
  magic      14 bytes  "COMPOSITE-KLD\\n"
  version    uint32    1
  header     uint32 length, then that many bytes of UTF-8 JSON:
             {"k", "vocab_size", "ctx", "score" ("all" | "second-half"), "bos_id" (int | null),
              "tokenizer_sha256", "text_sha256", "chunks": [[token ids of each chunk]],
              "records", "reference"}
  records    one per scored token, in order (chunk by chunk, position by position):
             int32 token, float32 log p(token), float32 log p(outside the top k) (-inf: none),
             k x int32 top ids (most probable first), k x float32 their log-probabilities
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from composite.errors import UserError
from composite.eval.metrics import Reference
from composite.eval.scoring import first_scored

MAGIC = b"COMPOSITE-KLD\n"
VERSION = 1
DEFAULT_K = 64


@dataclass
class Header:
    k: int
    vocab_size: int
    ctx: int
    score: str
    bos_id: int | None
    tokenizer_sha256: str
    text_sha256: str
    chunks: list[list[int]]
    records: int
    reference: str

    def check_matches(self, other: Header, path: Path) -> None:
        """The evaluation `other` scores what this file was written for, or one line says what differs."""
        for field, what in (
            ("tokenizer_sha256", "tokenizer"),
            ("text_sha256", "text"),
            ("vocab_size", "vocabulary size"),
            ("ctx", "--ctx"),
            ("score", "--score"),
            ("bos_id", "BOS"),
        ):
            theirs, ours = getattr(self, field), getattr(other, field)
            if theirs != ours:
                shown = [-1 if v is None else v for v in (theirs, ours)]  # as composite_runner says it
                raise UserError(
                    f"kld-base file {path} was written for another {what} ('{shown[0]}', this evaluation has "
                    f"'{shown[1]}')"
                )
        if self.chunks != other.chunks:
            raise UserError(f"kld-base file {path} was written for other tokens (--limit_tokens or the text differ)")


class Writer:
    def __init__(self, path: Path, header: Header):
        self.path, self.header, self.records = path, header, []

    def add(self, logp: torch.Tensor, token: int) -> None:
        k = self.header.k
        top = torch.topk(logp, k)
        rest = 1.0 - float(torch.sum(torch.exp(top.values)))
        logp_rest = math.log(rest) if rest > 0 else -math.inf
        record = struct.pack("<iff", token, float(logp[token]), logp_rest)
        record += struct.pack(f"<{k}i", *top.indices.tolist()) + struct.pack(f"<{k}f", *top.values.tolist())
        self.records.append(record)

    def close(self) -> None:
        self.header.records = len(self.records)
        header = json.dumps(self.header.__dict__).encode()
        try:
            with open(self.path, "wb") as f:
                f.write(MAGIC + struct.pack("<II", VERSION, len(header)) + header + b"".join(self.records))
        except OSError as e:
            raise UserError(f"cannot write the kld-base file {self.path}: {e.strerror}") from None


def read(path: Path) -> tuple[Header, list[Reference]]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the kld-base file {path}: {e.strerror}") from None
    if not data.startswith(MAGIC):
        raise UserError(f"{path} is not a kld-base file (composite.eval --kld-base-out writes them)")
    try:
        version, length = struct.unpack_from("<II", data, len(MAGIC))
        if version != VERSION:
            raise UserError(f"kld-base file {path} has version {version}; this reads {VERSION}")
        start = len(MAGIC) + 8
        header = Header(**json.loads(data[start : start + length]))
        k, offset = header.k, start + length
        size = 12 + 8 * k
        if len(data) - offset != header.records * size:
            raise UserError(f"kld-base file {path} is truncated: {header.records} records do not fit its length")
        references, tokens = [], []
        for _ in range(header.records):
            token, logp_token, logp_rest = struct.unpack_from("<iff", data, offset)
            tokens.append(token)
            ids = torch.tensor(struct.unpack_from(f"<{k}i", data, offset + 12), dtype=torch.int64)
            logps = torch.tensor(struct.unpack_from(f"<{k}f", data, offset + 12 + 4 * k), dtype=torch.float64)
            references.append(Reference(logp_token, int(ids[0]), ids, logps, logp_rest))
            offset += size
    except (struct.error, ValueError, TypeError, KeyError) as e:
        raise UserError(f"kld-base file {path} is malformed: {e}") from None
    first = first_scored(header.ctx, header.score)
    if tokens != [token for chunk in header.chunks for token in chunk[first:]]:
        raise UserError(f"kld-base file {path} is malformed: its records are not the tokens its chunks score")
    return header, references
