"""Tokenizers the runners understand: SentencePiece (Llama 2 family), Llama 3 tiktoken, and
Hugging Face tokenizer.json (Python runner only)."""

from __future__ import annotations

import base64
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
    def __init__(self, path: Path, kind: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"tokenizer {self.path} does not exist")
        self.kind = kind or detect_type(self.path)
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
        elif self.kind == TIKTOKEN:
            from pytorch_tokenizers import TiktokenTokenizer

            try:
                self._tt = TiktokenTokenizer(model_path=str(self.path))
            except Exception as e:  # tiktoken raises plain ValueError/KeyError on bad ranks files
                raise UserError(f"tokenizer {self.path} is not a valid tiktoken file: {e}") from None
            self.vocab_size = self._tt.n_words
            self.bos_id = self._tt.bos_id
            # Chat models end a turn with <|eot_id|> (or <|eom_id|>) rather than <|end_of_text|>.
            stops = {self._tt.special_tokens.get(t) for t in ("<|eot_id|>", "<|eom_id|>")} - {None}
            self.eos_ids = tuple(sorted({self._tt.eos_id, *stops}))
        elif self.kind == HF_JSON:
            from pytorch_tokenizers import HuggingFaceTokenizer

            try:
                self._hf = HuggingFaceTokenizer(str(self.path))
            except Exception as e:  # the tokenizers library raises its own Exception subclass
                raise UserError(f"tokenizer {self.path} is not a valid tokenizer.json: {e}") from None
            self.vocab_size = self._hf.n_words
            self.bos_id = self._hf.bos_id
            self.eos_ids = (self._hf.eos_id,)
        else:
            raise UserError(f"unknown tokenizer type '{self.kind}'")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        if self.kind == SENTENCEPIECE:
            ids = self._sp.EncodeAsIds(text)
        elif self.kind == TIKTOKEN:
            ids = self._tt.encode(text, bos=False, eos=False)
        else:
            ids = self._hf.encode(text, bos=False, eos=False)
        return ([self.bos_id] if bos and self.bos_id is not None and self.bos_id >= 0 else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        if self.kind == SENTENCEPIECE:
            return self._sp.DecodeIds(list(ids))
        if self.kind == TIKTOKEN:
            return self._tt.decode(list(ids))
        return self._hf.decode(list(ids))


def train_sentencepiece(text: str, vocab_size: int) -> bytes:
    """A byte-fallback BPE model in Llama 2's id conventions (unk 0, bos 1, eos 2), deterministic."""
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
