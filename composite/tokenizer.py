"""Tokenizers the runners understand: SentencePiece (Llama 2 family), Llama 3 tiktoken, and
Hugging Face byte-level BPE tokenizer.json (Llama 3 / 3.2). runner_cpp/tokenizer.cpp is the C++ twin."""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

from composite.errors import UserError

SENTENCEPIECE, TIKTOKEN, HF_JSON = "sentencepiece", "tiktoken", "hf_json"


def detect_type(path: Path) -> str:
    if path.suffix == ".json":
        return HF_JSON
    try:
        head = path.read_bytes()[:4096]
    except OSError as e:
        raise UserError(f"cannot read tokenizer {path}: {e.strerror}") from None
    first_line = head.split(b"\n", 1)[0].split()
    if len(first_line) == 2 and first_line[1].isdigit():
        try:
            base64.b64decode(first_line[0], validate=True)
            return TIKTOKEN
        except ValueError:
            pass
    return SENTENCEPIECE


class Tokenizer:
    """encode/decode for the three kinds, with special tokens parsed in text as composite_runner
    parses them (runner_cpp/tokenizer.cpp); stop ids for the manifest, and the chat family whose
    builtin template (composite/chat_template.py) serves when the tokenizer ships none."""

    def __init__(self, path: Path, kind: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"tokenizer {self.path} does not exist")
        self.kind = kind or detect_type(self.path)
        self.config = hf_tokenizer_config(self.path)  # tokenizer_config.json beside it, or {}
        self.chat_family: str | None = None
        if self.kind == SENTENCEPIECE:
            import sentencepiece

            self._sp = sentencepiece.SentencePieceProcessor()
            try:
                self._sp.Load(str(self.path))
            except (OSError, RuntimeError):
                raise UserError(f"tokenizer {self.path} is neither a SentencePiece model nor a tiktoken file") from None
            self.vocab_size = self._sp.vocab_size()
            self.bos_id = self._sp.bos_id()
            self.eos_ids = (self._sp.eos_id(),)
            # SentencePiece reads "<s>" in text as characters; Hugging Face's Llama tokenizer and
            # llama.cpp parse the control and unknown pieces as special tokens.
            self.specials = {
                self._sp.IdToPiece(i): i
                for i in range(self.vocab_size)
                if self._sp.IsControl(i) or self._sp.IsUnknown(i)
            }
            self.chat_family = "llama2"
        elif self.kind == TIKTOKEN:
            from pytorch_tokenizers import TiktokenTokenizer

            try:
                self._tt = TiktokenTokenizer(model_path=str(self.path))
            except Exception as e:  # tiktoken raises plain ValueError/KeyError on bad ranks files
                raise UserError(f"tokenizer {self.path} is not a valid tiktoken file: {e}") from None
            self.vocab_size = self._tt.n_words
            self.bos_id = self._tt.bos_id
            self.specials = dict(self._tt.special_tokens)
            self.eos_ids = self._stop_ids(self._tt.eos_id)
            self.chat_family = "llama3"
        elif self.kind == HF_JSON:
            from tokenizers import Tokenizer as HfTokenizer

            self.bos_id = check_hf_json(self.path)
            try:
                self._hf = HfTokenizer.from_file(str(self.path))
            except Exception as e:  # the tokenizers library raises its own Exception subclass
                raise UserError(f"tokenizer {self.path} is not a valid tokenizer.json: {e}") from None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            self.specials = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
            eos_token = self.config.get("eos_token")
            if isinstance(eos_token, dict):  # older configs spell an AddedToken out
                eos_token = eos_token.get("content")
            eos = self.specials.get(eos_token) if isinstance(eos_token, str) else None
            self.eos_ids = self._stop_ids(eos)
            if "<|start_header_id|>" in self.specials and "<|eot_id|>" in self.specials:
                self.chat_family = "llama3"
        else:
            raise UserError(f"unknown tokenizer type '{self.kind}'")

    def _stop_ids(self, eos: int | None) -> tuple[int, ...]:
        # Chat models end a turn with <|eot_id|> (or <|eom_id|>) rather than the end of text.
        stops = {self.specials.get(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")} | {eos}
        return tuple(sorted(stops - {None}))

    def encode(self, text: str, bos: bool = True, parse_special: bool = True) -> list[int]:
        """Ids of `text`, with the tokenizer's BOS first when `bos`. With `parse_special`,
        special-token strings in the text become their ids; otherwise they are text."""
        if self.kind == HF_JSON:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        elif self.kind == TIKTOKEN:
            allowed = "all" if parse_special else set()
            ids = self._tt.encode(text, bos=False, eos=False, allowed_special=allowed, disallowed_special=())
        else:
            ids = []
            for part in split_specials(text, self.specials if parse_special else {}):
                ids += [self.specials[part]] if part in self.specials and parse_special else self._sp.EncodeAsIds(part)
        return ([self.bos_id] if bos and self.bos_id is not None and self.bos_id >= 0 else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        if self.kind == SENTENCEPIECE:
            return self._sp.DecodeIds(list(ids))
        if self.kind == TIKTOKEN:
            return self._tt.decode([i for i in ids if i < self._tt.n_words - len(self.specials)])
        return self._hf.decode(list(ids), skip_special_tokens=True)


def split_specials(text: str, specials: dict[str, int]) -> list[str]:
    """`text` cut around the special-token strings in it: the leftmost match first, the longest at
    one position; the pieces between them kept, empty ones dropped."""
    if not specials:
        return [text] if text else []
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    return [part for part in re.split(f"({pattern})", text) if part]


def hf_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json beside a tokenizer.json, or {}."""
    config = path.parent / "tokenizer_config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_hf_json(path: Path) -> int | None:
    """Refuses what composite_runner's tokenizer.json reader (runner_cpp/hf_tokenizer.cpp) does not
    support, naming it; returns the BOS its post-processor puts before the text, if any."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer {path} is not a valid tokenizer.json: {e}") from None
    try:
        return _check_hf_json(doc, f"tokenizer {path}")
    except (AttributeError, KeyError, TypeError, IndexError) as e:  # a field of an unexpected JSON type
        raise UserError(f"tokenizer {path} is malformed: {type(e).__name__} {e}") from None


def _check_hf_json(doc, where: str) -> int | None:
    model = doc.get("model") if isinstance(doc, dict) else None
    kind = model.get("type", "BPE") if isinstance(model, dict) else "none"
    if kind != "BPE":
        raise UserError(f"{where} has model type {kind}; only byte-level BPE is supported")
    if doc.get("normalizer") is not None:
        raise UserError(f"{where} has a {doc['normalizer'].get('type', '?')} normalizer; byte-level BPE has none")
    if "ByteLevel" not in _pre_tokenizer_types(doc.get("pre_tokenizer"), where):
        raise UserError(f"{where} has no ByteLevel pre-tokenizer: not a byte-level BPE")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key) not in (None, ""):
            raise UserError(f"{where} sets BPE {key}, which byte-level BPE does not use")
    for token in doc.get("added_tokens") or []:
        for option in ("single_word", "lstrip", "rstrip"):
            if token.get(option):
                raise UserError(f"{where} has added token '{token.get('content')}' with {option}, unsupported")
    before = _tokens_before_text(doc.get("post_processor"), where)
    if len(before) > 1:
        raise UserError(f"{where} post-processor puts {len(before)} tokens before the text; one BOS is supported")
    return before[0] if before else None


def _pre_tokenizer_types(p, where: str) -> list[str]:
    if p is None:
        return []
    kind = p.get("type", "")
    if kind == "Sequence":
        return [t for step in p.get("pretokenizers", []) for t in _pre_tokenizer_types(step, where)]
    if kind == "Split":
        behavior = p.get("behavior", "")
        if behavior not in ("Isolated", "Removed") or p.get("invert"):
            inverted = " inverted" if p.get("invert") else ""
            raise UserError(
                f"{where} has a Split pre-tokenizer with behavior {behavior}{inverted}; Isolated and Removed are supported"
            )
        return [kind]
    if kind in ("ByteLevel", "Digits"):
        return [kind]
    raise UserError(
        f"{where} has a {kind or 'malformed'} pre-tokenizer; Split, Digits, ByteLevel and Sequence are supported"
    )


def _tokens_before_text(p, where: str) -> list[int]:
    if p is None:
        return []
    kind = p.get("type", "")
    if kind == "Sequence":
        return [i for step in p.get("processors", []) for i in _tokens_before_text(step, where)]
    if kind == "TemplateProcessing":
        ids = []
        for item in p.get("single", []):
            if "Sequence" in item:
                break
            if "SpecialToken" in item:
                ids += p["special_tokens"][item["SpecialToken"]["id"]]["ids"]
        return ids
    if kind == "ByteLevel":
        return []
    raise UserError(f"{where} has a {kind} post-processor; TemplateProcessing, ByteLevel and Sequence are supported")


def train_sentencepiece(text: str, vocab_size: int, identity_normalization: bool = False) -> bytes:
    """A byte-fallback BPE model in Llama 2's id conventions (unk 0, bos 1, eos 2), deterministic.
    identity_normalization: text kept as it is, whitespace runs included, as Llama 2's model has it
    (else SentencePiece's default NFKC normalization, which folds runs of spaces)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(line for line in text.splitlines() if line.strip()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        **(
            {"normalization_rule_name": "identity", "remove_extra_whitespaces": False} if identity_normalization else {}
        ),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def tokenizer_for_model(path: str | Path | None, vocab: int) -> Tokenizer | None:
    """The tokenizer an export ships: the one given or found beside the checkpoint, checked against
    the model's vocabulary."""
    if path is None:
        print("note: no tokenizer found beside the checkpoint; runners will need --prompt-ids", file=sys.stderr)
        return None
    tokenizer = Tokenizer(Path(path))
    if tokenizer.vocab_size > vocab:
        raise UserError(
            f"tokenizer {path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {vocab}: "
            "wrong tokenizer for this checkpoint?"
        )
    if tokenizer.vocab_size < vocab:
        print(
            f"note: tokenizer has {tokenizer.vocab_size} tokens, the model {vocab} (padded vocabulary)", file=sys.stderr
        )
    return tokenizer


def generation_stop_ids(loaded, tokenizer: Tokenizer | None, chat: dict | None) -> list[int]:
    """Every id that ends generation (loaded: a LoadedModel): the checkpoint's, the tokenizer's,
    the chat template's end of turn."""
    ids = set(loaded.eos_ids) | set(tokenizer.eos_ids if tokenizer else ())
    if chat is not None:
        ids.add(chat["end_of_turn_id"])
    return sorted(ids)


def prompt_bos_id(loaded, tokenizer: Tokenizer | None) -> int | None:
    """The id before a text prompt (loaded: a LoadedModel). A tokenizer.json's post-processor
    decides BOS, as transformers applies it; otherwise the checkpoint's config, then the tokenizer."""
    if tokenizer is not None and tokenizer.kind == "hf_json":
        return tokenizer.bos_id
    if loaded.bos_id is not None:
        return loaded.bos_id
    return tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id >= 0 else None
