"""python -m composite.eval: what an export's placement costs in quality, on real text.

    python -m composite.eval --artifacts DIR --text FILE [--ctx N] [--limit-tokens N]
        [--score all|second-half] [--reference DIR | --reference eager] [--kld-base FILE]
        [--per-shard] [--kld-base-out FILE] [--json]

Perplexity of the export on the text; with a reference (the float model of the export's checkpoint
in PyTorch, another export of the same model, or a kld-base file) the KL divergence and the other
figures of llama.cpp's llama-perplexity --kl-divergence (composite/eval/metrics.py). --per-shard:
each shard's output SQNR against the float shard given the same inputs, on this text, so the shard
that breaks a model shows. --kld-base-out: the reference's probabilities on the scored tokens, for
composite_runner --eval_text --kld_base on a phone (composite/eval/kld_base.py).
"""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    quiet.silence_library_noise()

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from composite import manifest as manifest_schema
from composite import manifest_files, qnn_host
from composite.errors import UserError, exits_cleanly
from composite.eval import kld_base
from composite.eval.metrics import Reference, Scores
from composite.eval.scoring import (
    SCORE_MODES,
    EagerModel,
    ExportModel,
    chunks,
    eval_tokens,
    first_scored,
    read_text,
)
from composite.eval.stream import evaluate_stream, report_stream
from composite.lowering.calibration import sqnr_db
from composite.runtime import context_shift
from composite.runtime.chain import ShardChain
from composite.runtime.encoding import Encoding, convert
from composite.runtime.reference import reference_model
from composite.split.plan import ShardSpec
from composite.split.shard import ShardModule
from composite.tokenizer import Tokenizer


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.eval", description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", required=True, help="the export to evaluate")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, help="tokens per chunk (default: the export's max_seq_len)")
    p.add_argument("--limit-tokens", "--limit_tokens", type=int, help="use the text's first N tokens")
    p.add_argument("--score", choices=SCORE_MODES, default="all", help="tokens scored per chunk (default all)")
    reference = p.add_mutually_exclusive_group()
    reference.add_argument("--reference", help="'eager' (the float model in PyTorch) or another export's folder")
    reference.add_argument("--kld-base", "--kld_base", help="a reference's probabilities, from --kld-base-out")
    p.add_argument("--per-shard", action="store_true", help="each shard's output SQNR against the float shard")
    p.add_argument("--kld-base-out", help="write the reference's probabilities here (needs --reference)")
    p.add_argument("--k", type=int, default=kld_base.DEFAULT_K, help="top tokens per position in --kld-base-out")
    p.add_argument(
        "--stream",
        action="store_true",
        help="score every token through the runner's shifting context instead of in chunks (composite/eval/stream.py)",
    )
    context_shift.add_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def same_model(manifest: dict, other: dict, where: str) -> None:
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if manifest["model"][key] != other["model"][key]:
            raise UserError(
                f"{where} is another model: its {key} is {other['model'][key]}, this export's {manifest['model'][key]}"
            )
    if (manifest.get("tokenizer") or {}).get("sha256") != (other.get("tokenizer") or {}).get("sha256"):
        raise UserError(f"{where} has another tokenizer than this export")


class ShardErrors:
    """Each shard's output against the float shard fed the same (dequantized) inputs."""

    def __init__(self, manifest: dict):
        model = reference_model(manifest, in_export_basis=True)
        self.shards = manifest["shards"]
        self.modules = [
            ShardModule(model, ShardSpec(s["index"], s["layers"][0], s["layers"][1], s["has_embedding"], s["has_head"]))
            for s in self.shards
        ]
        self.signal = [0.0] * len(self.shards)
        self.noise = [0.0] * len(self.shards)
        self.worst = [float("inf")] * len(self.shards)
        self.pending = None

    def inputs(self, index: int, method: str, inputs: list) -> None:
        entries = self.shards[index]["io"][method]["inputs"]
        self.pending = [convert(t, Encoding.of(e), None) for t, e in zip(inputs, entries)]

    def outputs(self, index: int, method: str, outputs: list) -> None:
        entry = self.shards[index]["io"][method]["outputs"][0]
        actual = convert(outputs[0], Encoding.of(entry), None).double()
        with torch.no_grad():
            expected = self.modules[index](*self.pending)[0].double()
        self.signal[index] += float(expected.pow(2).sum())
        self.noise[index] += float((expected - actual).pow(2).sum())
        self.worst[index] = min(self.worst[index], sqnr_db(expected, actual))

    def summary(self) -> list[dict]:
        out = []
        for s, signal, noise, worst in zip(self.shards, self.signal, self.noise, self.worst):
            db = float("inf") if noise == 0 else 10 * torch.log10(torch.tensor(signal / noise)).item()
            out.append(
                {
                    "index": s["index"],
                    "backend": s["placement"]["backend"],
                    "layers": s["layers"],
                    "sqnr_db": round(db, 2),
                    "sqnr_worst_token_db": round(worst, 2),
                }
            )
        return out


def streamed(args, folder: Path, manifest: dict, tokenizer) -> dict:
    """--stream (composite/eval/stream.py)."""
    given = [
        flag
        for flag, value in (
            ("--ctx", args.ctx),
            ("--kld-base", args.kld_base),
            ("--kld-base-out", args.kld_base_out),
            ("--per-shard", args.per_shard),
            ("--score", args.score != "all"),
        )
        if value
    ]
    if given:
        raise UserError(f"--stream scores every token through the export's context: drop {', '.join(given)}")
    if args.reference not in (None, "eager"):
        raise UserError("--stream compares with the float model only: --reference eager")
    shift = context_shift.from_flags(args, manifest)
    ids = eval_tokens(tokenizer, read_text(args.text), args.limit_tokens)
    reference = reference_model(manifest) if args.reference == "eager" else None
    return evaluate_stream(ShardChain(folder), manifest, ids, shift, reference)


def evaluate(args) -> dict:
    folder = Path(args.artifacts)
    manifest = manifest_schema.read(folder)
    entry = manifest.get("tokenizer")
    if not entry:
        raise UserError("this export has no tokenizer, so it cannot read a text")
    tokenizer = Tokenizer(folder / entry["file"], entry["type"])
    if args.limit_tokens is not None and args.limit_tokens < 2:
        raise UserError(f"--limit-tokens must be at least 2, got {args.limit_tokens}")
    if args.stream:
        return streamed(args, folder, manifest, tokenizer)
    if args.keep is not None or args.evict is not None or args.no_context_shift:
        raise UserError("--keep, --evict and --no-context-shift are for --stream (chunks never pass the context)")
    ctx = args.ctx or manifest["max_seq_len"]
    if ctx > manifest["max_seq_len"]:
        raise UserError(f"--ctx {ctx} is larger than this export's max_seq_len {manifest['max_seq_len']}")
    if args.kld_base_out and not args.reference:
        raise UserError("--kld-base-out writes the reference's probabilities: give --reference too")
    text = read_text(args.text)
    pieces = chunks(eval_tokens(tokenizer, text, args.limit_tokens), ctx, manifest.get("bos_id"))
    header = kld_base.Header(
        k=args.k,
        vocab_size=manifest["model"]["vocab_size"],
        ctx=ctx,
        score=args.score,
        bos_id=manifest.get("bos_id"),
        tokenizer_sha256=manifest_files.sha256_file(folder / entry["file"]),
        text_sha256=hashlib.sha256(text.encode()).hexdigest(),
        chunks=pieces,
        records=0,
        reference=args.reference or "",
    )
    base_references = None
    if args.kld_base:
        base_header, base_references = kld_base.read(Path(args.kld_base))
        base_header.check_matches(header, Path(args.kld_base))
    if any(s["placement"]["backend"] == "qnn" for s in manifest["shards"]):
        qnn_host.activate()
    chain = ShardChain(folder)
    tested = ExportModel(chain)
    reference = None
    if args.reference == "eager":
        reference = EagerModel(reference_model(manifest))
    elif args.reference:
        other = manifest_schema.read(Path(args.reference))
        same_model(manifest, other, f"--reference {args.reference}")
        reference = ExportModel(ShardChain(Path(args.reference)))
    writer = kld_base.Writer(Path(args.kld_base_out), header) if args.kld_base_out else None
    shard_errors = ShardErrors(manifest) if args.per_shard else None
    if shard_errors is not None:
        chain.input_observer, chain.output_observer = shard_errors.inputs, shard_errors.outputs
    scores = Scores()
    first = first_scored(ctx, args.score)
    record = 0
    progress = tqdm(
        total=len(pieces) * (ctx - 1),
        desc="evaluating",
        unit="token",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    for chunk in pieces:
        references = reference.logits(chunk) if reference is not None else None
        for position, logp in tested.logits(chunk):
            progress.update()
            ref = next(references)[1] if references is not None else None
            if position + 1 < first:
                continue
            token = chunk[position + 1]
            if base_references is not None:
                scores.add(logp, token, base_references[record])
            else:
                scores.add(logp, token, Reference.full(ref, token) if ref is not None else None)
            if writer is not None:
                writer.add(ref, token)
            record += 1
    progress.close()
    if writer is not None:
        writer.close()
    result = scores.summary()
    result["tokens_per_s"] = tested.tokens / tested.seconds if tested.seconds else 0.0
    result["chunks"], result["ctx"], result["score"] = len(pieces), ctx, args.score
    if shard_errors is not None:
        result["shards"] = shard_errors.summary()
    return result


def report(result: dict) -> None:
    print(
        f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens ({result['chunks']} chunks of "
        f"{result['ctx']}, scoring {result['score']}), {result['tokens_per_s']:.1f} tokens/s"
    )
    if "kld_mean" in result:
        print(
            f"against the reference: mean KLD {result['kld_mean']:.6f} (p50 {result['kld_p50']:.6f}, p90 "
            f"{result['kld_p90']:.6f}, p99 {result['kld_p99']:.6f}, max {result['kld_max']:.6f}), top-1 agreement "
            f"{100 * result['top1_agreement']:.2f}%, PPL ratio {result['ppl_ratio']:.4f}, RMS Δp "
            f"{100 * result['rms_dp']:.3f}%"
        )
    for shard in result.get("shards", []):
        first, end = shard["layers"]
        print(
            f"shard {shard['index']} ({shard['backend']}, layers {first}-{end - 1 if end > first else '-'}): "
            f"output SQNR {shard['sqnr_db']:.1f} dB, worst token {shard['sqnr_worst_token_db']:.1f} dB"
        )


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.reference is not None and args.reference != "eager" and not Path(args.reference).is_dir():
        raise UserError(f"--reference must be 'eager' or an export folder; {args.reference} is neither")
    if any(s["placement"]["backend"] == "qnn" for s in manifest_schema.read(Path(args.artifacts))["shards"]):
        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    with quiet.filtered_native_stderr(args.verbose):
        result = evaluate(args)
    if args.json:
        print(json.dumps(result))
    else:
        (report_stream if args.stream else report)(result)


if __name__ == "__main__":
    main()
