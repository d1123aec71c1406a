"""Several tokens per call (composite/runtime/speculate.py, runner_cpp/speculate.cpp): the trees a
verify call carries, lossless greedy output in both runners, only accepted entries in the cache,
the verify method's weights stored once, and bad input."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from composite.runtime.shard_call import tree_visibility
from composite.runtime.speculate import Lookahead, PromptLookup, Tree, accepted_path
from conftest import RUNNER, assert_clean_failure, export, made_once, run_cli

# The tiny default model goes on repeating this prompt's last six tokens for a while, then leaves them.
REPEATING = [1, 270, 229, 177, 342, 277, 305, 165, 331, 458, 342, 277, 305, 165, 331, 458, 342]
PROMPTS = [REPEATING, [1, 200, 17, 345, 88, 4, 401, 23], [1, *range(40, 70)]]


def test_a_row_sees_itself_and_its_ancestors_only():
    # root -> a -> b, root -> c; one padding row
    seen = tree_visibility([-1, 0, 1, 0], 5)
    assert seen.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, False, False, True, False],
        [False, False, False, False, True],
    ]


def test_the_accepted_path_follows_the_greedy_choices_from_the_root():
    tree = Tree([7, 8, 9, 4, 8, 5], [-1, 0, 1, 2, 0, 4])  # 7 -> 8 -> 9 -> 4, and 7 -> 8 -> 5
    # row 0 chooses 8 (the first such child: row 1), row 1 chooses 9, row 2 chooses 3 (not 4)
    path, ahead = accepted_path(tree, [8, 9, 3, 0, 5, 0])
    assert path == [0, 1, 2] and ahead == [8, 9, 3]
    path, ahead = accepted_path(tree, [2, 9, 3, 0, 5, 0])  # nothing accepted: the root's choice
    assert path == [0] and ahead == [2]


def test_prompt_lookup_copies_what_followed_the_most_recent_match():
    guesser = PromptLookup(ngram=2, width=4)
    history = guesser.begin([1, 2, 3, 4, 1, 2, 6, 7, 8, 5, 1, 2], 0)
    tree = guesser.tree(history)  # "1 2" last followed by 6 7 8
    assert tree.tokens == [2, 6, 7, 8] and tree.parents == [-1, 0, 1, 2]
    assert guesser.tree(guesser.begin([1, 2, 3], 0)) is None  # nothing repeats
    assert guesser.tree(guesser.begin([3, 9, 9, 4, 3], 0)).tokens == [3, 9, 9, 4]  # a 1-gram match


def test_the_lookahead_window_and_its_candidates_form_one_tree():
    guesser = Lookahead(window=2, ngram=3, candidates=1)
    history = guesser.begin([10, 11, 12, 13, 14, 10, 15], 0)
    assert guesser.levels == [[13, 14], [10, 15]]  # the text's last tokens
    tree = guesser.tree(history)
    # root 15; level 0: 13 -> 14 (a chain after the root); level 1 over each column; the pooled
    # continuation of 15: none yet (15 is the text's last token)
    assert tree.tokens == [15, 13, 14, 10, 15]
    assert tree.parents == [-1, 0, 1, 1, 2]
    guesser.learn(tree, [0, 0, 0, 21, 22])  # the top level's predictions
    assert guesser.levels == [[10, 15], [21, 22]]
    assert guesser.pool[13] == [(10, 21)] and guesser.pool[14] == [(15, 22)]
    assert guesser.pool[10] == [(11, 12)]  # the text's own n-grams are pooled too
    history.append(13)
    tree = guesser.tree(history)  # 13's pooled continuation, checked after the window
    assert tree.tokens[-2:] == [10, 21] and tree.parents[-2:] == [0, len(tree.tokens) - 2]


def test_a_tree_cut_keeps_its_shallow_rows():
    tree = Tree([7, 8, 9, 4, 5], [-1, 0, 1, 2, 0]).cut(1)
    assert tree.tokens == [7, 8, 5] and tree.parents == [-1, 0, 0]


@pytest.fixture(scope="module")
def chain(default_exports):
    from composite.runtime.chain import ShardChain

    return ShardChain(default_exports[3])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_guessing_gives_exactly_the_plain_greedy_tokens(chain, prompt):
    plain = generate(chain, prompt, 40, Sampler()).tokens
    for guesser in (PromptLookup(3, 8), Lookahead(2, 3, 1), Lookahead(1, 4, 1)):
        g = generate(chain, prompt, 40, Sampler(), guesser=guesser)
        assert g.tokens == plain, type(guesser).__name__
        assert g.verify_calls > 0 or isinstance(guesser, PromptLookup)


def test_only_the_accepted_entries_reach_the_cache(chain):
    plain = generate(chain, REPEATING, 30, Sampler())
    cache = [(k.clone(), v.clone()) for k, v in zip(chain.cache.k, chain.cache.v)]
    guessed = generate(chain, REPEATING, 30, Sampler(), guesser=Lookahead(2, 3, 1))
    assert guessed.tokens == plain.tokens and guessed.in_cache == plain.in_cache
    assert guessed.accepted < guessed.verify_calls * 6  # guesses were rejected, and left no trace:
    used = plain.in_cache
    for (k, v), (k_plain, v_plain) in zip(zip(chain.cache.k, chain.cache.v), cache):
        assert torch.allclose(k[..., :used], k_plain[..., :used], atol=1e-5)
        assert torch.allclose(v[:, :used], v_plain[:, :used], atol=1e-5)
        assert not k[..., used:].any() and not v[:, used:].any()  # the slots after stay empty


def test_the_runners_agree_on_tokens_and_calls(default_exports, needs_runner, tmp_path):
    export_folder = default_exports[3]
    ids = ",".join(map(str, REPEATING))
    for flags in (["--prompt_lookup", "2"], ["--lookahead", "2,3,1"], []):
        args = ["--artifacts", str(export_folder), "--prompt_ids", ids, "--max_new_tokens", "48", *flags]
        stats = tmp_path / "stats.json"
        result = subprocess.run([str(RUNNER), *args, "--stats_json", str(stats)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        cpp = json.loads(stats.read_text())
        python = json.loads(run_cli("composite.run", *args, "--json", check=True).stdout)
        for key in ("tokens", "verify_calls", "tokens_per_call", "accepted_per_call"):
            assert cpp[key] == python[key], (flags, key)
        if flags:
            assert cpp["tokens_per_call"] > 1.0


@pytest.fixture(scope="module")
def without_verify(workdir):
    return made_once(workdir / "default_1_no_verify", lambda p: export(p, shards=1, verify_len=0))


def test_the_verify_method_stores_no_second_copy_of_the_weights(default_exports, without_verify):
    with_verify = json.loads((default_exports[1] / "manifest.json").read_text())
    without = json.loads((without_verify / "manifest.json").read_text())
    assert with_verify["methods"]["verify"] == 8 and "verify" not in without["methods"]
    extra = with_verify["shards"][0]["size"] - without["shards"][0]["size"]
    assert 0 < extra < 0.05 * without["shards"][0]["size"], (extra, without["shards"][0]["size"])


@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--lookahead", "4,3,1"], ["needs 11 rows per call", "verify method takes 8"]),
        (["--lookahead", "0,3,1"], ["WINDOW >= 1"]),
        (["--lookahead", "2,3"], ["WINDOW,NGRAM,CANDIDATES"]),
        (["--prompt_lookup", "0"], [">= 1"]),
        (["--prompt_lookup", "2", "--lookahead", "2,3,1"], ["give one"]),
        (["--prompt_lookup", "2", "--temperature", "0.7"], ["greedily", "--temperature"]),
    ],
)
def test_bad_guessing_flags_get_one_line_in_both_runners(default_exports, needs_runner, flags, phrases):
    args = ["--artifacts", str(default_exports[1]), "--prompt_ids", "1,2,3", *flags]
    assert_clean_failure(subprocess.run([str(RUNNER), *args], capture_output=True, text=True), *phrases)
    assert_clean_failure(run_cli("composite.run", *args), *phrases)


def test_an_export_without_a_verify_method_is_refused_for_guessing(without_verify, needs_runner):
    args = ["--artifacts", str(without_verify), "--prompt_ids", "1,2,3", "--max_new_tokens", "4"]
    for flags in (["--prompt_lookup", "2"], ["--lookahead"]):
        phrases = ("needs an export with a verify method", "--verify-len")
        assert_clean_failure(subprocess.run([str(RUNNER), *args, *flags], capture_output=True, text=True), *phrases)
        assert_clean_failure(run_cli("composite.run", *args, *flags), *phrases)
    assert subprocess.run([str(RUNNER), *args], capture_output=True).returncode == 0  # plain decode still runs
