"""Calibration inputs for quantized shards, captured from the float model itself.

A shard in the middle of the model sees hidden states, positions, masks and KV caches, not text.
The float shards are chained exactly as the runners chain the exported ones (runtime/chain.py),
text is pushed through them (prefill chunks, then teacher-forced decode steps, so caches are
partly filled as in real use) and the inputs each quantized shard receives are recorded per method.

YAML (per QNN shard or under `qnn:`):
  calibration:
    prompts: ["...", "..."]   # or
    file: calib.txt           # a text file; default: the text shipped with the package
    samples: 16               # per method (decode and prefill)
One more sample per method is held out and used only to measure the shard's SQNR.
"""

from __future__ import annotations

from pathlib import Path

import torch

from composite.errors import UserError
from composite.manifest import DECODE, PREFILL

DEFAULT_SAMPLES = 16
CALIBRATION_KEYS = ("prompts", "file", "samples")


def calibration_text(options: dict) -> str:
    from composite.model.default import corpus_text

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


def capture_shard_inputs(model, shard_modules: list, targets: set[int], methods: dict[str, int],
                         max_seq_len: int, options: dict, tokenizer) -> dict[int, dict[str, list[tuple]]]:
    """shard index -> method -> list of input tuples (samples + 1 held out, the last)."""
    from composite.runtime.chain import eager_chain

    wanted = int(options.get("samples", DEFAULT_SAMPLES)) + 1
    chain = eager_chain(model, shard_modules, methods, max_seq_len)
    captured = {index: {method: [] for method in methods} for index in targets}
    for index in targets:
        for method, run in list(chain.runners[index].items()):
            def recording(inputs, run=run, store=captured[index][method]):
                if len(store) < wanted:
                    store.append(tuple(t.clone() for t in inputs))
                return run(inputs)
            chain.runners[index][method] = recording

    width = methods[PREFILL]
    # Each pass: a few prefill chunks (filling the first half of the cache at most), then decode
    # steps up to the end of the cache.
    chunks_per_pass = max(1, min(wanted, (max_seq_len // 2) // width))
    decode_per_pass = max(1, max_seq_len - chunks_per_pass * width - 1)
    passes = max(-(-wanted // chunks_per_pass), -(-wanted // decode_per_pass))
    per_pass = chunks_per_pass * width + min(decode_per_pass, wanted)
    stream = token_stream(options, tokenizer, model.args.vocab_size, passes * per_pass)
    cursor = 0
    for _ in range(passes):
        chain.reset()
        pos = 0
        for _ in range(chunks_per_pass):
            chain.forward(PREFILL, stream[cursor : cursor + width], pos)
            pos += width
            cursor += width
        for _ in range(min(decode_per_pass, wanted)):
            chain.forward(DECODE, [stream[cursor]], pos)
            pos += 1
            cursor += 1
    return captured


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB."""
    reference, actual = reference.double().flatten(), actual.double().flatten()
    noise = (reference - actual).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))
