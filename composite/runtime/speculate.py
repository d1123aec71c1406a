"""Several tokens per call, greedy and lossless: guesses checked by the verify method.

A decode step reads every weight of every shard for one token; a verify call of W tokens reads them
once for all W. Each step puts the token to be decoded (the root) and guesses after it into one
call, as a tree: every row sits at the position after its parent and sees only its ancestors (and
the cache), so each row's logits are exactly those of the sequence that ends in it. Walking from
the root, a guess is accepted while it is the greedy choice of its parent's row; the row after the
last accepted guess gives one more token. The tokens are those of plain greedy decode; only the
accepted path's cache entries are kept (Chain.commit), the rest never reach the cache.

Where the guesses come from:
  PromptLookup  the tokens that followed the most recent earlier occurrence of the last n tokens
                in the text so far (prompt and answer); n from --prompt-lookup N down to 1
                (Saxena 2023, llama.cpp's lookup).
  Lookahead     Jacobi iteration over a window of future positions (Fu et al., ICML 2024): n-1
                levels of `window` guesses ride along in every call; each call's predictions at
                the top level finish n-grams that go into a pool, beside the text's own n-grams;
                the pool's n-grams that start with the root are checked in the same call
                (`candidates` of them).
composite_runner's speculate.cpp builds the same trees, so both runners make the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from composite.errors import UserError
from composite.runtime.shard_call import tree_depths


@dataclass
class Tree:
    """A verify call's rows: tokens[0] is the root (the token to decode), parents[i] < i."""

    tokens: list[int]
    parents: list[int]

    @property
    def depths(self) -> list[int]:
        return tree_depths(self.parents)

    def cut(self, max_depth: int) -> Tree:
        """The rows no deeper than max_depth (their ancestors are shallower, so they stay)."""
        depths = self.depths
        kept = [i for i, d in enumerate(depths) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(kept)}
        return Tree([self.tokens[i] for i in kept], [new_index.get(self.parents[i], -1) for i in kept])


def accepted_path(tree: Tree, choices: list[int]) -> tuple[list[int], list[int]]:
    """Greedy verification: choices[i] is row i's greedy token. -> (rows of the accepted path,
    root first; the tokens it yields: each accepted guess, then the choice of the last row)."""
    children: dict[int, list[int]] = {}
    for row, parent in enumerate(tree.parents):
        if parent >= 0:
            children.setdefault(parent, []).append(row)
    path, row = [0], 0
    while True:
        nxt = next((c for c in children.get(row, []) if tree.tokens[c] == choices[row]), None)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt
    return path, [tree.tokens[r] for r in path[1:]] + [choices[row]]


class Guesser:
    """What both guessers share: the text so far, which the runner extends token by token."""

    history: list[int]

    def begin(self, prompt: list[int], start_pos: int) -> list[int]:
        """A generation's start: its prompt, after what the cache holds (start_pos > 0, a chat's
        later turn, continues the same text). -> the history list the runner appends to."""
        if start_pos == 0 or not hasattr(self, "history"):
            self.history = []
        self.history += prompt
        return self.history


@dataclass
class PromptLookup(Guesser):
    """Guesses copied from the text so far: after the most recent earlier occurrence of its last
    n tokens (n = ngram .. 1), up to width - 1 of the tokens that followed."""

    ngram: int
    width: int

    def tree(self, history: list[int]) -> Tree | None:
        """history: every token so far, the root last; None when nothing matches."""
        end = len(history)
        for n in range(min(self.ngram, end - 1), 0, -1):
            tail = history[end - n :]
            for start in range(end - n - 1, -1, -1):  # most recent first; the tail itself excluded
                if history[start : start + n] == tail:
                    guesses = history[start + n : start + n + self.width - 1]
                    return Tree([history[-1], *guesses], list(range(-1, len(guesses))))
        return None

    def learn(self, tree: Tree, choices: list[int]) -> None:
        """Nothing to learn: the text is the pool."""


@dataclass
class Lookahead(Guesser):
    """Jacobi lookahead: levels[l][j] (l < ngram-1, j < window) is a guess at depth j+l+1, row
    (l, j) seeing the root, level 0's columns up to j and its own column's lower levels. The top
    level's predictions finish, per column, an n-gram (its column's guesses, then the
    prediction), pooled by first token; the window then moves up one level, the predictions on
    top. The text's own n-grams (prompt and answer) go into the same pool as they come. Up to
    `candidates` pooled continuations of the root, the most recent first, are checked in the same
    call."""

    window: int
    ngram: int
    candidates: int
    levels: list[list[int]] = field(default_factory=list)
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    pooled: int = 0  # the history's n-grams ending before this are in the pool

    @property
    def rows(self) -> int:
        return 1 + (self.ngram - 1) * (self.window + self.candidates)

    def begin(self, prompt: list[int], start_pos: int) -> list[int]:
        """Also the window's first guesses: the text's last tokens in order (repeated if short)."""
        if start_pos == 0:
            self.pool, self.pooled = {}, 0
        history = super().begin(prompt, start_pos)
        count = (self.ngram - 1) * self.window
        source = history[-count:] if len(history) >= count else [history[i % len(history)] for i in range(count)]
        self.levels = [source[i * self.window : (i + 1) * self.window] for i in range(self.ngram - 1)]
        return history

    def tree(self, history: list[int]) -> Tree:
        for end in range(max(self.pooled, self.ngram), len(history) + 1):
            self._pool(history[end - self.ngram : end])  # the text's own n-grams, as they come
        self.pooled = len(history) + 1
        tokens, parents = [history[-1]], [-1]
        below = [0] * self.window  # the row under each column so far
        for height, level in enumerate(self.levels):
            for j, token in enumerate(level):
                parent = (0 if j == 0 else len(tokens) - 1) if height == 0 else below[j]
                below[j] = len(tokens)
                tokens.append(token)
                parents.append(parent)
        for continuation in reversed(self.pool.get(history[-1], [])[-self.candidates :] if self.candidates else []):
            parent = 0
            for token in continuation:
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens) - 1
        return Tree(tokens, parents)

    def learn(self, tree: Tree, choices: list[int]) -> None:
        if len(tree.tokens) < 1 + (self.ngram - 1) * self.window:
            return  # the window was cut (the end of the answer or of the cache is near)
        top = 1 + (self.ngram - 2) * self.window  # the first row of the top level
        predicted = choices[top : top + self.window]
        for j, prediction in enumerate(predicted):
            self._pool([level[j] for level in self.levels] + [prediction])
        self.levels = [*self.levels[1:], predicted]

    def _pool(self, gram: list[int]) -> None:
        known = self.pool.setdefault(gram[0], [])
        continuation = tuple(gram[1:])
        if continuation in known:
            known.remove(continuation)
        known.append(continuation)  # most recent last
        del known[: -max(1, self.candidates)]


DEFAULT_LOOKAHEAD = (2, 3, 1)  # window, n-gram size, candidates: 7 rows, within the default verify width 8


def add_flags(parser) -> None:
    """--prompt-lookup and --lookahead, as composite.run takes them (composite_runner spells them
    --prompt_lookup and --lookahead)."""
    parser.add_argument(
        "--prompt-lookup",
        "--prompt_lookup",
        type=int,
        metavar="N",
        help="guess the next tokens from the text so far (its last N..1 tokens matched), checked several per call",
    )
    parser.add_argument(
        "--lookahead",
        nargs="?",
        const=",".join(map(str, DEFAULT_LOOKAHEAD)),
        metavar="WINDOW,NGRAM,CANDIDATES",
        help="lookahead decoding: guesses from Jacobi iteration, checked several per call "
        f"(default {','.join(map(str, DEFAULT_LOOKAHEAD))})",
    )


def from_flags(args, manifest: dict):
    """The guesser the flags ask for, or None for plain decode; one line and exit 2 where the
    export or the other flags cannot give one."""
    lookahead = parse_lookahead(args.lookahead)
    if args.prompt_lookup is None and lookahead is None:
        return None
    flag = "--prompt-lookup" if args.prompt_lookup is not None else "--lookahead"
    if args.prompt_lookup is not None and lookahead is not None:
        raise UserError("--prompt-lookup and --lookahead are two ways of guessing: give one")
    width = manifest["methods"].get("verify")
    if width is None:
        raise UserError(
            f"{flag} needs an export with a verify method (this one has none): re-export with --verify-len 8"
        )
    if args.temperature > 0:
        raise UserError(f"{flag} decodes greedily (the same tokens as plain greedy decode): drop --temperature")
    if args.prompt_lookup is not None:
        if args.prompt_lookup < 1:
            raise UserError(f"--prompt-lookup takes the longest n-gram to match, >= 1, got {args.prompt_lookup}")
        return PromptLookup(args.prompt_lookup, width)
    window, ngram, candidates = lookahead
    if window < 1 or ngram < 2 or candidates < 0:
        raise UserError(
            f"--lookahead WINDOW,NGRAM,CANDIDATES needs WINDOW >= 1, NGRAM >= 2 and CANDIDATES >= 0, got {args.lookahead}"
        )
    guesser = Lookahead(window, ngram, candidates)
    if guesser.rows > width:
        raise UserError(
            f"--lookahead {args.lookahead} needs {guesser.rows} rows per call (1 + (NGRAM-1) x (WINDOW+CANDIDATES)) "
            f"but this export's verify method takes {width}"
        )
    return guesser


def parse_lookahead(text: str | None) -> tuple[int, int, int] | None:
    """--lookahead WINDOW,NGRAM,CANDIDATES."""
    if text is None:
        return None
    try:
        window, ngram, candidates = (int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--lookahead takes WINDOW,NGRAM,CANDIDATES (e.g. 2,3,1), got '{text}'") from None
    return window, ngram, candidates
