"""Chat turns in the template of the model's family (the manifest's "chat" entry), and the chat
loop: each user turn prefilled after what the cache already holds. runner_cpp/chat.cpp and
runner_cpp/main.cpp (chat) are the C++ twins."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from composite.errors import UserError
from composite.runtime.generate import Generation, generate

# What the templates trim from each message (runner_cpp/chat.cpp trims the same ASCII set).
WHITESPACE = " \t\n\r\f\v"


def _llama3_header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def turn_tokens(tokenizer, chat: dict, bos_id: int | None, first: bool, system: str | None, user: str) -> list[int]:
    """The tokens of a user turn and the assistant header after it. The first turn opens the
    conversation (BOS, the system message); a later one first closes the assistant turn before it."""
    ids = [] if first else [chat["end_of_turn_id"]]
    system = (system or "").strip(WHITESPACE)
    if chat["template"] == "llama3":
        if first and bos_id is not None:
            ids.append(bos_id)
        text = _llama3_header("system") + system + "<|eot_id|>" if first and system else ""
        text += _llama3_header("user") + user.strip(WHITESPACE) + "<|eot_id|>" + _llama3_header("assistant")
    else:  # llama2: every user turn opens with BOS; the system message goes inside the first one
        if bos_id is not None:
            ids.append(bos_id)
        content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}" if first and system else user
        text = f"[INST] {content.strip(WHITESPACE)} [/INST]"
    return ids + tokenizer.encode(text, bos=False, parse_special=True)


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
) -> Conversation:
    """One user turn per non-blank line. An answer ends at any stop id; one cut short keeps its
    last token, sampled but not yet in the cache, for the next turn to prefill."""
    if not manifest.get("chat"):
        raise UserError("this export records no chat template (its tokenizer is of no known chat family)")
    stops = set(manifest["eos_ids"])
    conversation = Conversation()
    carried: list[int] = []
    for line in lines:
        if not line.strip(WHITESPACE):
            continue
        first = conversation.in_cache == 0
        turn = carried + turn_tokens(tokenizer, manifest["chat"], manifest["bos_id"], first, system, line)
        if conversation.in_cache + len(turn) >= seq_len:
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
        )
        if on_turn_end:
            on_turn_end()
        conversation.turns.append(Turn(conversation.in_cache, turn, g))
        conversation.in_cache += len(turn) + len(g.tokens) - 1
        carried = [] if g.tokens[-1] in stops else [g.tokens[-1]]
        if g.stop_reason in ("max_seq_len", "seq_len"):
            conversation.context_full = f"the context is full ({seq_len} tokens): the chat ends here"
            break
    return conversation
