"""Chat turns in the model's own template (the manifest's "chat" entry: the text around each
message, rendered and checked at export by composite/chat_template.py), and the chat loop: each
user turn prefilled after what the cache already holds. runner_cpp/chat.cpp and
runner_cpp/main.cpp (chat) are the C++ twins."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from composite.chat_template import WHITESPACE
from composite.errors import UserError
from composite.runtime.generate import Generation, generate


def turn_tokens(tokenizer, chat: dict, first: bool, system: str | None, user: str) -> list[int]:
    """The tokens of a user turn, up to where the answer begins. The first turn opens the
    conversation (with the system message, if any: an empty one is none); a later one first closes
    the answer before it with the end-of-turn token."""

    def content(role: str, text: str) -> str:
        return text.strip(WHITESPACE) if role in chat["trim"] else text

    if first and system:
        text = chat["system_prefix"] + content("system", system) + chat["system_suffix"]
    else:
        text = chat["first_user_prefix"] if first else chat["user_prefix"]
    text += content("user", user) + chat["user_suffix"]
    return ([] if first else [chat["end_of_turn_id"]]) + tokenizer.encode(text, bos=False, parse_special=True)


@dataclass
class Turn:
    start_pos: int
    prompt: list[int]
    generation: Generation

    def stats(self) -> dict:
        g = self.generation
        return {
            "start_pos": self.start_pos,
            "prompt": self.prompt,
            "prompt_tokens": len(self.prompt),
            "tokens": g.tokens,
            "stop_reason": g.stop_reason,
            "prefill_tokens_per_s": g.prefill_tokens_per_s,
            "decode_tokens_per_s": g.decode_tokens_per_s,
        }


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    in_cache: int = 0  # tokens the cache holds
    context_full: str | None = None  # why the chat ended early, said in one line


def chat(
    chain,
    tokenizer,
    manifest: dict,
    lines: Iterable[str],
    sampler,
    max_new_tokens: int,
    seq_len: int,
    system: str | None = None,
    on_turn_start: Callable[[list[int]], Callable[[int], None] | None] | None = None,
    on_turn_end: Callable[[], None] | None = None,
    shift=None,
    guesser=None,
) -> Conversation:
    """One user turn per non-blank line. An answer ends at any stop id; one cut short keeps its
    last token, sampled but not yet in the cache, for the next turn to prefill. seq_len: tokens in
    all (0: no limit); shift: a ContextShift that evicts the oldest turns past the context, or None
    to end the chat at seq_len; guesser: runtime/speculate.py's, or None for plain decode."""
    if not manifest.get("chat"):
        raise UserError(
            "this export records no chat template (its tokenizer has none): export with --chat-template FILE"
        )
    if system and manifest["chat"]["system_prefix"] is None:
        raise UserError("this model's chat template has no system role: drop --system")
    stops = set(manifest["eos_ids"])
    conversation = Conversation()
    carried: list[int] = []
    for line in lines:
        line = line.removesuffix("\n").removesuffix("\r")  # the line's end is not the message's
        if not line.strip(WHITESPACE):
            continue
        first = not conversation.turns and not carried
        turn = carried + turn_tokens(tokenizer, manifest["chat"], first, system, line)
        if shift is not None and not shift.fits(len(turn)):
            conversation.context_full = shift.too_long("this turn", len(turn)) + ": the chat ends here"
            break
        if seq_len and conversation.in_cache + len(turn) >= seq_len:
            conversation.context_full = (
                f"the context is full ({conversation.in_cache} of {seq_len} tokens used, this turn needs "
                f"{len(turn)} more): the chat ends here"
            )
            break
        on_token = on_turn_start(turn) if on_turn_start else None
        g = generate(
            chain,
            turn,
            max_new_tokens,
            sampler,
            manifest["eos_ids"],
            on_token=on_token,
            seq_len=seq_len,
            start_pos=conversation.in_cache,
            shift=shift,
            guesser=guesser,
        )
        if on_turn_end:
            on_turn_end()
        conversation.turns.append(Turn(conversation.in_cache, turn, g))
        conversation.in_cache = g.in_cache
        carried = [] if g.tokens[-1] in stops else [g.tokens[-1]]
        if g.stop_reason in ("max_seq_len", "seq_len"):
            conversation.context_full = f"the context is full ({seq_len} tokens): the chat ends here"
            break
    return conversation
