"""A model's own chat template, rendered at export into the text the runners put around each
message, and checked against the Jinja rendering itself.

Templates are Jinja, rendered as transformers renders them (a sandboxed environment with
trim_blocks, lstrip_blocks and loop controls; `raise_exception`, `strftime_now`, `tojson`). A C++
runner has no Jinja engine, so the export renders conversations of placeholder messages and reads
off the pieces between them:

  first turn, with a system message:  system_prefix SYSTEM system_suffix USER user_suffix
  first turn, without one:            first_user_prefix USER user_suffix
  every later turn:                   <end of turn> user_prefix USER user_suffix

user_suffix ends with the generation prompt (the assistant's header); the model's answer follows
and ends with the end-of-turn token, which both runners stop on. Contents are trimmed for the
roles whose template trims them. The pieces are then checked to reproduce the Jinja rendering of
probe conversations (with and without a system message, up to three turns, padded contents); a
template they cannot reproduce is refused in one line. runtime/chat.py and runner_cpp/chat.cpp
assemble turns from the pieces (the manifest's "chat" entry).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from composite import manifest as manifest_schema
from composite.errors import UserError, exits_cleanly

# Python's str.strip() whitespace, which Jinja's `trim` removes (runner_cpp/chat.cpp trims the same).
WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

# Templates for tokenizers that ship none, by the family their special tokens show: Llama 3's
# Instruct template as its tokenizer_config.json carries it, and Llama 2's chat template with each
# message trimmed on its own (Meta's trims the system message and the first user message as one
# text, which differs only for messages with surrounding whitespace).
BUILTIN = {
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message.strip() + '\\n<</SYS>>\\n\\n' + message['content'].strip() %}"
        "{% else %}{% set content = message['content'].strip() %}{% endif %}{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
}

# Placeholder contents: private-use characters no template adds or trims.
SYSTEM = "\ue000system\ue001"
USERS = ["\ue000user1\ue001", "\ue000user2\ue001", "\ue000user3\ue001"]
ANSWERS = ["\ue000answer1\ue001", "\ue000answer2\ue001", "\ue000answer3\ue001"]
PADDING = " \n "


class TemplateError(Exception):
    """Rendering failed (a template error, or the template's own raise_exception)."""


def environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.undefined = jinja2.Undefined
    return env


class Renderer:
    def __init__(self, template: str, bos_token: str, eos_token: str, source: str):
        import jinja2

        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self.template = environment().from_string(template)
        except jinja2.TemplateError as e:
            raise UserError(f"chat template ({source}) is not valid Jinja: {e}") from None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
            )
        except (jinja2.TemplateError, TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from None


def conversation(system: str | None, users: list[str], answers: list[str]) -> list[dict]:
    messages = [] if system is None else [{"role": "system", "content": system}]
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def _between(text: str, before: str | None, after: str | None, what: str, refuse) -> str:
    start = 0
    if before is not None:
        if text.count(before) != 1:
            refuse(f"it does not render the {what} as given")
        start = text.index(before) + len(before)
    end = len(text)
    if after is not None:
        if text.count(after) != 1 or text.index(after) < start:
            refuse(f"it does not render the {what} as given")
        end = text.index(after)
    return text[start:end]


def end_of_turn(suffix: str, specials: dict[str, int], refuse) -> tuple[int, str]:
    """The special token that closes an assistant's answer (the first one after its content) and
    the text after it, up to the next user's content."""
    found = None
    for token, token_id in specials.items():
        at = suffix.find(token)
        if at >= 0 and (found is None or at < found[0] or (at == found[0] and len(token) > len(found[1]))):
            found = (at, token, token_id)
    if found is None:
        refuse(f"an assistant's answer is closed by {suffix!r}, which holds no special token to stop generation on")
    at, token, token_id = found
    if suffix[:at].strip(WHITESPACE):
        refuse(f"it puts {suffix[:at]!r} between an answer and its end-of-turn token {token}")
    return token_id, suffix[at + len(token) :]


def pieces(renderer: Renderer, specials: dict[str, int]) -> dict:
    """The manifest's chat entry for a template: its pieces, checked on probe conversations."""

    def refuse(why: str):
        raise UserError(f"chat template ({renderer.source}) cannot be run by composite's runners: {why}")

    def render(messages, add_generation_prompt=True) -> str:
        try:
            return renderer(messages, add_generation_prompt)
        except TemplateError as e:
            shown = ", ".join(m["role"] for m in messages)
            refuse(f"rendering a conversation of {shown} failed: {e}")

    try:
        with_system = renderer(conversation(SYSTEM, USERS[:1], []))
    except TemplateError:
        with_system = None  # a template without a system role, which says so
    if with_system is not None and SYSTEM not in with_system:
        with_system = None  # one that drops system messages
    without_system = render(conversation(None, USERS[:1], []))
    chat = {
        "source": renderer.source,
        "system_prefix": None,
        "system_suffix": None,
        "first_user_prefix": _between(without_system, None, USERS[0], "user message", refuse),
        "user_suffix": _between(without_system, USERS[0], None, "user message", refuse),
    }
    if with_system is not None:
        chat["system_prefix"] = _between(with_system, None, SYSTEM, "system message", refuse)
        chat["system_suffix"] = _between(with_system, SYSTEM, USERS[0], "system message", refuse)
        if _between(with_system, USERS[0], None, "user message", refuse) != chat["user_suffix"]:
            refuse("it closes the first user message differently with and without a system message")
    two_turns = render(conversation(None, USERS[:2], ANSWERS[:1]))
    # What the template puts between a user message and an earlier answer must be the generation
    # prompt, plus at most whitespace, which the model's answer itself begins with (Llama 2's " ").
    answer_prefix = _between(two_turns, USERS[0], ANSWERS[0], "assistant message", refuse)
    if not answer_prefix.startswith(chat["user_suffix"]) or answer_prefix[len(chat["user_suffix"]) :].strip(WHITESPACE):
        refuse(
            f"it opens an earlier answer with {answer_prefix!r}, not with its generation prompt {chat['user_suffix']!r}"
        )
    answer_suffix = _between(two_turns, ANSWERS[0], USERS[1], "assistant message", refuse)
    chat["end_of_turn_id"], chat["user_prefix"] = end_of_turn(answer_suffix, specials, refuse)
    chat["trim"] = [
        role
        for role, messages, content in (
            ("system", conversation(PADDING + SYSTEM + PADDING, USERS[:1], []), SYSTEM),
            ("user", conversation(None, [PADDING + USERS[0] + PADDING], []), USERS[0]),
        )
        if (role != "system" or with_system is not None) and PADDING + content + PADDING not in render(messages)
    ]
    answer = answer_prefix[len(chat["user_suffix"]) :]
    # Exact on contents without surrounding whitespace; a template that trims them in some places
    # only (Llama 2's trims a user message after a system message at its end alone) gets them
    # trimmed everywhere, and says so.
    check(chat, render, answer, answer_suffix, padded=False, refuse=refuse)
    try:
        check(chat, render, answer, answer_suffix, padded=True, refuse=refuse)
    except UserError:
        chat["trim"] = ["system", "user"] if with_system is not None else ["user"]
        print(
            f"note: chat template ({renderer.source}) trims surrounding whitespace from messages in some places "
            "only; the runners trim every message",
            file=sys.stderr,
        )
    return chat


def compose(chat: dict, system: str | None, users: list[str], answers: list[str], answer_suffix: str) -> str:
    """The text a conversation becomes from the pieces, each earlier answer closed by
    `answer_suffix` (what the template puts after an answer, end-of-turn token included)."""

    def content(role: str, text: str) -> str:
        return text.strip(WHITESPACE) if role in chat["trim"] else text

    if system is not None:
        text = chat["system_prefix"] + content("system", system) + chat["system_suffix"]
    else:
        text = chat["first_user_prefix"]
    for i, user in enumerate(users):
        if i:
            text += answers[i - 1] + answer_suffix
        text += content("user", user) + chat["user_suffix"]
    return text


def check(chat: dict, render, answer_prefix: str, answer_suffix: str, padded: bool, refuse) -> None:
    """The pieces give the template's own rendering of conversations of one to three turns, with
    and without a system message (contents padded with whitespace when `padded`)."""

    def pad(text: str) -> str:
        return PADDING + text + PADDING if padded else text

    systems = [None] + ([pad(SYSTEM)] if chat["system_prefix"] is not None else [])
    answers = [answer_prefix + a for a in ANSWERS]
    for system in systems:
        for turns in (1, 2, 3):
            users = [pad(u) for u in USERS[:turns]]
            expected = render(conversation(system, users, ANSWERS[: turns - 1]))
            got = compose(chat, system, users, answers[: turns - 1], answer_suffix)
            if got != expected:
                shown = "a system message and " if system is not None else ""
                refuse(
                    f"its rendering of {shown}{turns} user turn(s) is not the same text around each message "
                    f"(expected {expected!r}, the pieces give {got!r})"
                )


def find_template(tokenizer_path: Path | None, override: str | None) -> tuple[str, str] | None:
    """(template, where it came from): --chat-template FILE, else chat_template.jinja or
    tokenizer_config.json's chat_template beside the tokenizer."""
    if override is not None:
        return read_template_file(Path(override)), str(override)
    if tokenizer_path is None:
        return None
    folder = Path(tokenizer_path).parent
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return read_template_file(jinja_file), str(jinja_file)
    config = folder / "tokenizer_config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template.strip():
        return template, f"{config} chat_template"
    return None


def read_template_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"chat template {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read chat template {path}: {e}") from None
    if not text.strip():
        raise UserError(f"chat template {path} is empty")
    return text


def special_token_text(tokenizer, token_id: int | None, config_value) -> str:
    if isinstance(config_value, dict):  # older configs spell an AddedToken out
        config_value = config_value.get("content")
    if isinstance(config_value, str):
        return config_value
    if token_id is None:
        return ""
    return next((text for text, i in tokenizer.specials.items() if i == token_id), "")


def chat_entry(
    tokenizer, bos_id: int | None, eos_ids, override: str | None, checkpoint_template: tuple[str, str] | None
) -> dict | None:
    """The manifest's chat entry for an export's tokenizer: --chat-template, else the checkpoint
    file's own template (GGUF), else the tokenizer's, else the builtin one of its family, rendered
    into pieces; None when there is none (the runners then refuse --chat)."""
    if tokenizer is None:
        if override is not None:
            raise UserError("--chat-template needs a tokenizer, and this export has none")
        return None
    found = checkpoint_template if override is None and checkpoint_template is not None else None
    found = found or find_template(tokenizer.path, override)
    if found is None and tokenizer.chat_family in BUILTIN:
        found = BUILTIN[tokenizer.chat_family], f"builtin {tokenizer.chat_family} template"
    if found is None:
        print("note: no chat template found with the tokenizer; --chat will be refused", file=sys.stderr)
        return None
    template, source = found
    config = tokenizer.config
    eos = eos_ids[0] if eos_ids else None
    renderer = Renderer(
        template,
        special_token_text(tokenizer, bos_id if bos_id is not None else tokenizer.bos_id, config.get("bos_token")),
        special_token_text(tokenizer, eos, config.get("eos_token")),
        source,
    )
    return pieces(renderer, tokenizer.specials)


def for_export(template_path: Path, tokenizer, manifest: dict) -> dict:
    """A runner's --chat-template FILE for an export: the JSON of a chat entry (what this module's
    CLI writes), or a Jinja template, rendered into one against the export's tokenizer."""
    text = read_template_file(template_path)
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        manifest_schema.check_chat(doc, f"--chat-template {template_path}")
        return doc
    eos_ids = manifest.get("eos_ids") or []
    renderer = Renderer(
        text,
        special_token_text(tokenizer, manifest.get("bos_id"), None),
        special_token_text(tokenizer, eos_ids[0] if eos_ids else None, None),
        str(template_path),
    )
    return pieces(renderer, tokenizer.specials)


@exits_cleanly
def main(argv=None) -> None:
    """python -m composite.chat_template TEMPLATE --artifacts DIR [--output FILE]: a Jinja chat
    template rendered into the JSON that composite_runner's --chat_template takes."""
    import argparse

    from composite.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m composite.chat_template", description=main.__doc__.split(":")[1])
    p.add_argument("template", help="a Jinja chat template file")
    p.add_argument("--artifacts", required=True, help="the export whose tokenizer the template is for")
    p.add_argument("--output", help="write the JSON here (default: stdout)")
    args = p.parse_args(argv)
    folder = Path(args.artifacts)
    manifest = manifest_schema.read(folder)
    entry = manifest.get("tokenizer")
    if not entry:
        raise UserError(f"the export in {folder} has no tokenizer, so it cannot chat")
    chat = for_export(Path(args.template), Tokenizer(folder / entry["file"], entry["type"]), manifest)
    text = json.dumps(chat, indent=1, ensure_ascii=False) + "\n"
    if args.output is None:
        sys.stdout.write(text)
        return
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot write {args.output}: {e.strerror}") from None


if __name__ == "__main__":
    main()
