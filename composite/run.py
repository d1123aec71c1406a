"""python -m composite.run: generate with an export's shards on the host (ExecuTorch Python runtime)."""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    # Run as the CLI: keep library chatter (torchao logs while ExecuTorch imports it) out before
    # those libraries load. Importing this module elsewhere changes nothing.
    quiet.silence_library_noise()

import argparse
import json
import platform
from pathlib import Path

from composite import chat_template, qnn_host
from composite import manifest as manifest_schema
from composite.errors import UserError, exits_cleanly
from composite.runtime import context_shift, speculate
from composite.runtime.chain import ShardChain
from composite.runtime.chat import chat
from composite.runtime.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    Generation,
    check_lengths,
    default_seq_len,
    generate,
    stats,
)
from composite.runtime.reference import generate_reference, reference_chain, reference_model
from composite.runtime.sampler import Sampler, fresh_seed
from composite.tokenizer import Tokenizer


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m composite.run",
        description=__doc__.split(":", 1)[1].strip(),
        epilog="Flags may also be spelled with underscores, as composite_runner's "
        "(--max_new_tokens); both runners share these defaults.",
    )
    p.add_argument("--artifacts", required=True, help="export folder (holds manifest.json)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (BOS added per the manifest)")
    prompt.add_argument("--prompt-ids", "--prompt_ids", help="prompt token ids, comma separated, used as given")
    prompt.add_argument(
        "--chat",
        action="store_true",
        help="chat in the model's template: user turns from stdin, one per line, until EOF",
    )
    p.add_argument("--system", help="system message of the chat")
    p.add_argument(
        "--chat-template",
        "--chat_template",
        help="the chat's template instead of the export's: a Jinja file, or the JSON composite.chat_template writes",
    )
    p.add_argument(
        "--special-as-text",
        "--special_as_text",
        action="store_true",
        help="encode special-token strings in the prompt (<|eot_id|>, </s>) as text",
    )
    p.add_argument(
        "--max-new-tokens",
        "--max_new_tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"stop after this many new tokens (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--seq-len",
        "--seq_len",
        type=int,
        help="stop at N tokens in all, prompt included (default: no limit; with --no-context-shift, max_seq_len)",
    )
    context_shift.add_flags(p)
    speculate.add_flags(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", "--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, help="sampling seed, 0 .. 2^64-1 (default: a fresh one, printed when sampling)")
    p.add_argument("--json", action="store_true", help="print the stats (as --stats-json writes them) instead of text")
    p.add_argument("--stats-json", "--stats_json", help="write the run's stats as JSON (composite_runner's schema)")
    p.add_argument(
        "--reference", action="store_true", help="run the unsplit eager PyTorch float model instead (--chat too)"
    )
    p.add_argument("--verify", action="store_true", help="check every shard's sha256 before loading")
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def prompt_tokens(args, manifest: dict, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got '{args.prompt_ids}'") from None
        vocab = manifest["model"]["vocab_size"]
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserError(f"--prompt-ids holds {bad[0]}, outside the vocabulary 0..{vocab - 1}")
        return ids
    if tokenizer is None:
        raise UserError("this export has no tokenizer: use --prompt-ids")
    if not args.prompt:
        raise UserError("the prompt is empty")
    bos = [] if manifest.get("bos_id") is None else [manifest["bos_id"]]
    return bos + tokenizer.encode(args.prompt, bos=False, parse_special=not args.special_as_text)


def load_tokenizer(folder: Path, manifest: dict):
    entry = manifest.get("tokenizer")
    if not entry:
        return None
    return Tokenizer(folder / entry["file"], entry["type"])


def peak_rss_mb() -> float:
    """This process's high-water mark (VmHWM), as composite_runner reports its own."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def continuation(tokenizer, context: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `context` (the prompt's last token): decoded alone, a
    SentencePiece piece would lose the space it starts with."""
    return tokenizer.decode(context + tokens)[len(tokenizer.decode(context)) :]


class TextStream:
    """Prints decoded text as tokens arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer, self.context, self.tokens, self.printed = tokenizer, context, [], ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = continuation(self.tokenizer, self.context, self.tokens)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> None:
        """What is still held back: bytes that never completed a character (shown replaced)."""
        self._write(continuation(self.tokenizer, self.context, self.tokens))

    def _write(self, text: str) -> None:
        sys.stdout.write(text[len(self.printed) :])
        sys.stdout.flush()
        self.printed = text


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    if not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise UserError(f"--seed must be in 0 .. 2^64-1, got {args.seed}")
    if args.system is not None and not args.chat:
        raise UserError("--system is for --chat")
    if args.chat_template is not None and not args.chat:
        raise UserError("--chat_template is for --chat")
    if args.chat and args.json:
        raise UserError("--chat prints text: drop --json (--stats-json writes the stats)")
    folder = Path(args.artifacts)
    manifest = manifest_schema.read(folder)
    if not args.reference and any(shard["placement"]["backend"] == "qnn" for shard in manifest["shards"]):
        qnn_host.activate()  # QNN shards run on the x86 HTP simulator: needs the loader path set
    with quiet.filtered_native_stderr(args.verbose):
        (chat_and_report if args.chat else generate_and_report)(args, folder, manifest)


def chat_and_report(args, folder: Path, manifest: dict) -> None:
    tokenizer = load_tokenizer(folder, manifest)
    if tokenizer is None:
        raise UserError("--chat needs a tokenizer, and this export has none")
    if args.chat_template is not None:
        chat_entry = chat_template.for_export(Path(args.chat_template), tokenizer, manifest)
        eos_ids = sorted(set(manifest["eos_ids"]) | {chat_entry["end_of_turn_id"]})
        manifest = {**manifest, "chat": chat_entry, "eos_ids": eos_ids}
    shift = context_shift.from_flags(args, manifest)
    seq_len = default_seq_len(args.seq_len, manifest["max_seq_len"], shift)
    check_lengths([0], args.max_new_tokens, seq_len, manifest["max_seq_len"], shift=shift)
    seed = fresh_seed() if args.seed is None else args.seed
    if args.temperature > 0 and args.seed is None:
        print(f"seed {seed} (--seed {seed} repeats this run)", file=sys.stderr)
    guesser = speculate.from_flags(args, manifest)
    if guesser is not None and args.reference:
        raise UserError("--reference runs the float model a token at a time: drop --prompt-lookup/--lookahead")
    chain = reference_chain(manifest) if args.reference else ShardChain(folder, verify=args.verify)
    streams = []

    def start_turn(turn: list[int]):
        streams.append(TextStream(tokenizer, turn[-1:]))
        return streams[-1]

    def end_turn():
        streams[-1].finish()
        print()

    def user_lines():
        while True:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                return
            yield line

    conversation = chat(
        chain,
        tokenizer,
        manifest,
        user_lines(),
        Sampler(args.temperature, args.top_p, seed),
        args.max_new_tokens,
        seq_len,
        args.system,
        on_turn_start=start_turn,
        on_turn_end=end_turn,
        shift=shift,
        guesser=guesser,
    )
    if conversation.context_full:
        print(conversation.context_full, file=sys.stderr)
    last = conversation.turns[-1].generation if conversation.turns else Generation([])
    has_qnn = any(shard["placement"]["backend"] == "qnn" for shard in manifest["shards"])
    report = stats(
        last,
        manifest,
        "reference" if args.reference else "composite.run",
        load_ms=getattr(chain, "load_seconds", 0.0) * 1e3,
        threads=None,
        seed=seed,
        peak_rss_mb=peak_rss_mb(),
        qnn_simulator=has_qnn and not args.reference and platform.machine() == "x86_64",
        turns=[turn.stats() for turn in conversation.turns],
        chat_context_shifts=shift.shifts if shift is not None else 0,  # the whole chat's
    )
    write_stats(args.stats_json, report)
    print(
        f"chat: {len(conversation.turns)} turns, {conversation.in_cache} tokens in the context; last turn prefill "
        f"{last.prefill_tokens_per_s:.1f} tok/s, decode {last.decode_tokens_per_s:.1f} tok/s",
        file=sys.stderr,
    )


def write_stats(path: str | None, report: dict) -> None:
    if not path:
        return
    try:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"cannot write --stats-json {path}: {e.strerror}") from None


def generate_and_report(args, folder: Path, manifest: dict) -> None:
    tokenizer = load_tokenizer(folder, manifest)
    prompt = prompt_tokens(args, manifest, tokenizer)
    seed = fresh_seed() if args.seed is None else args.seed
    if args.temperature > 0 and args.seed is None:
        print(f"seed {seed} (--seed {seed} repeats this run)", file=sys.stderr)
    sampler = Sampler(args.temperature, args.top_p, seed)
    eos = tuple(manifest["eos_ids"])
    shift = context_shift.from_flags(args, manifest)
    guesser = speculate.from_flags(args, manifest)
    if guesser is not None and args.reference:
        raise UserError("--reference runs the float model a token at a time: drop --prompt-lookup/--lookahead")
    stream = TextStream(tokenizer, prompt[-1:]) if tokenizer is not None and not args.json else None
    load_seconds = 0.0
    if args.reference:
        generation = generate_reference(
            reference_model(manifest),
            prompt,
            args.max_new_tokens,
            manifest["max_seq_len"],
            sampler,
            eos,
            on_token=stream,
            seq_len=args.seq_len,
        )
    else:
        chain = ShardChain(folder, verify=args.verify)
        load_seconds = chain.load_seconds
        generation = generate(
            chain,
            prompt,
            args.max_new_tokens,
            sampler,
            eos,
            on_token=stream,
            seq_len=args.seq_len,
            shift=shift,
            guesser=guesser,
        )
    has_qnn = any(shard["placement"]["backend"] == "qnn" for shard in manifest["shards"])
    report = stats(
        generation,
        manifest,
        "reference" if args.reference else "composite.run",
        load_ms=load_seconds * 1e3,
        threads=None,  # ExecuTorch's Python runtime sizes its own threadpool
        seed=seed,
        peak_rss_mb=peak_rss_mb(),
        qnn_simulator=has_qnn and not args.reference and platform.machine() == "x86_64",
        text=continuation(tokenizer, prompt[-1:], generation.tokens) if tokenizer is not None else None,
    )
    write_stats(args.stats_json, report)
    if args.json:
        print(json.dumps(report))
        return
    if stream is None:
        print(" ".join(map(str, generation.tokens)))
    else:
        stream.finish()
        print()
    if generation.stop_reason == "max_seq_len":
        print(f"stopped: reached max_seq_len {manifest['max_seq_len']}", file=sys.stderr)
    print(
        f"prompt {len(prompt)} tokens, generated {len(generation.tokens)} ({generation.stop_reason}); "
        f"prefill {generation.prefill_tokens_per_s:.1f} tok/s, decode {generation.decode_tokens_per_s:.1f} tok/s"
        f"{f' ({generation.tokens_per_call:.2f} tokens per call)' if guesser is not None else ''}, "
        f"first token {generation.first_token_seconds * 1e3:.1f} ms",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
