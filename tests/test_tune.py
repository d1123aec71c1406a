"""composite.tune on the tiny default: the recipe it picks is the best within the budget over its own
measurements, its config exports as it says (sizes, and the KLD composite.eval measures on the
export), a second budget reuses the measurements, and bad input gets one line."""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from composite.config import build_config
from composite.memory import descendants
from composite.tune.search import Option, best_within, frontier
from conftest import DEBIAN_TEXT, REPO, assert_clean_failure, run_cli

# Real text from a Debian package: base-files ships the GNU GPL's text.
TEXT = DEBIAN_TEXT
SMALL = ["--ctx", "64", "--limit-tokens", "256", "--max-seq-len", "64", "--prefill-len", "16", "--shards", "4"]
MIXED = ["--candidates", "qnn:16a4w_block,xnnpack:fp32,xnnpack:8da4w", "--embedding", "none|4,32"]

pytestmark = pytest.mark.usefixtures("needs_debian_text")


def tune(folder: Path, budget_mb: float, *flags: str) -> dict:
    args = ["--text", str(TEXT), "--budget-mb", str(budget_mb), "--output", str(folder / "tuned.yaml")]
    args += ["--cache-dir", str(folder / "cache"), *SMALL, *flags, "--json"]
    return json.loads(run_cli("composite.tune", *args, check=True).stdout)


def best_by_brute_force(result: dict, budget_mb: float) -> float:
    """The lowest summed KLD of any one-choice-per-group combination within the budget."""
    per_group = [list(g["choices"].values()) for g in result["groups"]]
    best = float("inf")
    for combination in itertools.product(*per_group):
        if sum(c["mb"] for c in combination) <= budget_mb + 1e-9:
            best = min(best, sum(c["kld"] for c in combination))
    return best


def tune_again(folder: Path, name: str, budget_mb: float, *flags: str) -> tuple[Path, dict]:
    """A second run in folder/name on the first run's measurement cache; its own YAML."""
    again = folder / name
    again.mkdir()
    (again / "cache").symlink_to(folder / "cache")
    return again, tune(again, budget_mb, *flags)


@pytest.fixture(scope="module")
def mixed(qnn_ready, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune_mixed")
    return folder, tune(folder, 1.6, *MIXED)


def test_the_frontier_is_the_exact_optimum_of_every_budget():
    rng = random.Random(7)
    groups = [
        [Option(g, c, rng.randrange(1, 40), 0, rng.random()) for c in range(rng.randrange(1, 5))] for g in range(6)
    ]
    recipes = frontier(groups)
    assert all(a.bytes < b.bytes and a.kld > b.kld for a, b in itertools.pairwise(recipes))
    for budget in range(0, 250, 7):
        fits = [c for c in itertools.product(*groups) if sum(o.bytes for o in c) <= budget]
        chosen = best_within(recipes, budget)
        if not fits:
            assert chosen is None
            continue
        assert chosen.kld == pytest.approx(min(sum(o.kld for o in c) for c in fits))
        assert chosen.bytes <= budget


def test_the_frontier_takes_off_what_the_first_and_last_groups_store_once():
    """A lookup and head that share the tied table: their bytes do not add, and the frontier is
    still the exact optimum of every budget."""
    rng = random.Random(11)
    groups = [
        [Option(g, c, rng.randrange(1, 40), 0, rng.random()) for c in range(rng.randrange(1, 5))] for g in range(5)
    ]

    def stored_once(first: Option, last: Option) -> int:
        return min(first.bytes, last.bytes) if (first.choice + last.choice) % 2 == 0 else 0

    recipes = frontier(groups, stored_once)
    assert all(a.bytes < b.bytes and a.kld > b.kld for a, b in itertools.pairwise(recipes))
    assert all([o.group for o in r.options] == list(range(5)) for r in recipes)

    def size(chosen) -> int:
        return sum(o.bytes for o in chosen) - stored_once(chosen[0], chosen[-1])

    for budget in range(0, 200, 5):
        fits = [c for c in itertools.product(*groups) if size(c) <= budget]
        chosen = best_within(recipes, budget)
        if not fits:
            assert chosen is None
            continue
        assert chosen.kld == pytest.approx(min(sum(o.kld for o in c) for c in fits))
        assert chosen.bytes == size(chosen.options) <= budget


def test_the_tied_table_is_stored_once_only_for_an_8_bit_lookup_and_an_8da8w_head():
    """tune's byte formula asks the export's rule (lowering/shared_table.head_mapping) through the
    tuned pair's config: of every embedding and head choice, tied or not, rotated or not, only a
    tied, unrotated "8,0" lookup with an XNNPACK 8da8w head saves, and it saves the lookup's bytes."""
    import dataclasses

    from composite.model.default import DEFAULT_ARGS
    from composite.tune.candidates import (
        DEFAULT_CANDIDATES,
        EMBEDDING_CHOICES,
        Group,
        group_bytes,
        parse_candidates,
        table_stored_once,
    )

    saving = {}
    for tied, rotation, embedding, head in itertools.product(
        (True, False), ("none", "hadamard", "hadamard-ffn"), EMBEDDING_CHOICES, parse_candidates(DEFAULT_CANDIDATES)
    ):
        args = dataclasses.replace(DEFAULT_ARGS, tie_embeddings=tied)
        saved = table_stored_once(embedding, head, args, rotation)
        if saved:
            saving[(tied, rotation, embedding, head.name)] = saved
    lookup = group_bytes(Group("embedding", 0), "8,0", DEFAULT_ARGS, 32)[0]
    assert saving == {(True, "none", "8,0", "xnnpack:8da8w"): lookup}


def test_the_chosen_recipe_is_the_best_within_the_budget(mixed):
    _, result = mixed
    chosen = result["chosen"]
    assert chosen["mb"] <= 1.6
    assert chosen["kld_predicted"] == pytest.approx(best_by_brute_force(result, 1.6), rel=1e-9)
    groups = {g["group"]: g["choices"] for g in result["groups"]}
    assert list(groups) == ["embedding", "layers 0-2", "layers 3-5", "head"]
    # The float choices cost nothing; every quantized one costs something and is smaller.
    for name in ("layers 0-2", "layers 3-5", "head"):
        assert groups[name]["xnnpack:fp32"]["kld"] == 0.0
        for quantized in ("xnnpack:8da4w", "qnn:16a4w_block"):
            assert groups[name][quantized]["kld"] > 0
            assert groups[name][quantized]["mb"] < groups[name]["xnnpack:fp32"]["mb"] / 4
    assert groups["embedding"]["embedding 4,32"]["kld"] > groups["embedding"]["embedding none"]["kld"] == 0.0
    assert chosen["kld_whole"] > 0


def test_the_tuned_config_is_the_chosen_recipe(mixed):
    folder, result = mixed
    path = folder / "tuned.yaml"
    config = build_config(str(path), {})
    data = yaml.safe_load(path.read_text())
    assert data["layers_per_shard"] == [0, 3, 3, 0] and data["shards"] == 4
    chosen = result["chosen"]["recipe"].split(" | ")
    assert data.get("embedding_quantize", "none") == chosen[0].removeprefix("emb ")
    for placement, name in zip(config.placements()[1:], chosen[1:]):
        backend, precision = name.split(":")
        assert placement.backend == backend
        if backend == "qnn":
            assert placement.options["precision"] == precision
        else:
            assert placement.options["quantize"] == ("none" if precision == "fp32" else precision)
    assert (folder / "tuned.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.read_text().startswith("# composite.tune:")


def test_another_budget_reuses_every_measurement(mixed):
    folder, first = mixed
    _, second = tune_again(folder, "other_budget", 0.9, *MIXED)
    assert all(c["cached"] for g in second["groups"] for c in g["choices"].values())
    assert [g["choices"] for g in second["groups"]] == [
        {k: {**v, "cached": True} for k, v in g["choices"].items()} for g in first["groups"]
    ]
    assert second["chosen"]["mb"] <= 0.9
    assert second["chosen"]["kld_predicted"] == pytest.approx(best_by_brute_force(second, 0.9), rel=1e-9)


def test_the_same_budget_again_writes_the_same_config(mixed):
    folder, _ = mixed
    again, _ = tune_again(folder, "same_budget", 1.6, *MIXED)
    assert (again / "tuned.yaml").read_text() == (folder / "tuned.yaml").read_text()


def test_measure_uniform_measures_the_named_candidates_uniform_recipes_as_a_whole(mixed):
    folder, first = mixed
    _, again = tune_again(folder, "uniform", 1.6, *MIXED, "--measure-uniform", "xnnpack:8da4w")
    whole = {label for label, u in again["uniform"].items() if "kld_whole" in u}
    assert whole == {"xnnpack:8da4w", "xnnpack:8da4w + embedding 4,32"}
    for label in whole:
        u = again["uniform"][label]
        assert u["kld_whole"] > 0 and 0 < u["top1_whole"] < 1
        assert u["kld_predicted"] == first["uniform"][label]["kld_predicted"]


def test_head_fixes_the_heads_choices_and_the_rest_is_searched_as_before(mixed):
    folder, _ = mixed
    _, again = tune_again(folder, "fixed_head", 1.6, *MIXED, "--head", "xnnpack:8da4w")
    groups = {g["group"]: g["choices"] for g in again["groups"]}
    assert list(groups["head"]) == ["xnnpack:8da4w"]
    assert all(c["cached"] for g in again["groups"] for c in g["choices"].values())
    assert again["chosen"]["recipe"].split(" | ")[-1] == "xnnpack:8da4w"
    assert again["chosen"]["kld_predicted"] == pytest.approx(best_by_brute_force(again, 1.6), rel=1e-9)
    # a uniform recipe of a candidate the head may not take keeps the head at its choice
    assert again["uniform"]["xnnpack:fp32"]["kld_predicted"] == groups["head"]["xnnpack:8da4w"]["kld"]


def test_a_budget_above_the_float_size_gives_the_float_model(mixed):
    folder, _ = mixed
    _, result = tune_again(folder, "large_budget", 1000, *MIXED)
    assert result["chosen"]["recipe"] == "emb none | xnnpack:fp32 | xnnpack:fp32 | xnnpack:fp32"
    assert result["chosen"]["kld_predicted"] == 0.0


def test_verify_exports_the_recipe_and_measures_what_was_predicted(tmp_path):
    """With both rotations: the export rotates the model as the tuner measured it."""
    flags = ["--shards", "3", "--candidates", "xnnpack:fp32,xnnpack:8da8w", "--embedding", "none|8,0", "--verify"]
    result = tune(tmp_path, 1.6, *flags, "--rotate", "hadamard-ffn", "--verify-limit-tokens", "128")
    assert yaml.safe_load((tmp_path / "tuned.yaml").read_text())["rotate"] == "hadamard-ffn"
    chosen, verified = result["chosen"], result["verified"]
    # the first two chunks of 64 (each scores all but its first token)
    assert verified["tokens"] == 2 * 63
    # XNNPACK runs the eager model's arithmetic: the export's KLD is the one measured in PyTorch on
    # the same tokens.
    assert chosen["kld_whole"] > 0
    assert verified["kld"] == pytest.approx(verified["kld_whole_same_tokens"], rel=0.05, abs=1e-6)
    # Stored bytes: the formula's, plus each .pte's program (its three methods' graphs, tens of KB each).
    assert chosen["mb"] * 1e6 <= verified["pte_bytes"] <= chosen["mb"] * 1e6 * 1.05 + 3 * 100_000


def test_a_stopped_tuner_says_so_in_one_line_and_writes_no_config(tmp_path):
    output = tmp_path / "tuned.yaml"
    args = ["--text", str(TEXT), "--budget-mb", "2", "--output", str(output), "--no-cache", *SMALL]
    tuner = subprocess.Popen(
        [sys.executable, "-m", "composite.tune", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not [p for p in descendants(tuner.pid) if p != tuner.pid]:  # measuring, in its worker
        assert tuner.poll() is None and time.monotonic() < deadline, "the tuner never started measuring"
        time.sleep(0.05)
    tuner.send_signal(signal.SIGTERM)
    _, stderr = tuner.communicate(timeout=120)
    stderr = stderr.decode()
    assert tuner.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert line == "error: the tuner was stopped (SIGTERM); no config was written", line  # --no-cache
    assert not output.exists()


def test_bad_input_gets_one_line(tmp_path):
    base = ["--text", str(TEXT), "--output", str(tmp_path / "t.yaml"), "--cache-dir", str(tmp_path / "c"), *SMALL]
    cases = [
        (["--budget-mb", "2", "--candidates", "qnn:16a2w"], "unknown candidate 'qnn:16a2w'"),
        (["--budget-mb", "2", "--embedding", "8,0|2,16"], "unknown embedding choice '2,16'"),
        (["--budget-mb", "2", "--head", "xnnpack:4da4w"], "unknown candidate 'xnnpack:4da4w'"),
        (["--budget-mb", "0.01"], "below the smallest recipe"),
        (["--budget-mb", "2", "--shards", "2"], "at least 3"),
        (["--budget-mb", "-1"], "--budget-mb must be positive"),
        (["--budget-mb", "2", "--verify", "--verify-limit-tokens", "32"], "less than one chunk (--ctx 64)"),
        (["--budget-mb", "2", "--verify", "--verify-limit-tokens", "512"], "more than --limit-tokens 256"),
        (["--budget-mb", "2", "--verify-limit-tokens", "128"], "is for --verify"),
        (["--budget-mb", "2", "--measure-uniform", "qnn:16a2w"], "unknown candidate 'qnn:16a2w'"),
        (
            ["--budget-mb", "2", "--candidates", "xnnpack:fp32,xnnpack:8da4w", "--measure-uniform", "xnnpack:8da8w"],
            "--measure-uniform xnnpack:8da8w is not among --candidates",
        ),
    ]
    for flags, phrase in cases:
        assert_clean_failure(run_cli("composite.tune", *base, *flags), phrase)
    missing = ["--text", str(tmp_path / "none.txt"), "--budget-mb", "2", "--output", str(tmp_path / "t.yaml")]
    assert_clean_failure(run_cli("composite.tune", *missing), "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_clean_failure(run_cli("composite.tune", *base[2:], "--text", str(empty), "--budget-mb", "2"), "is empty")
    not_yaml = ["--text", str(TEXT), "--budget-mb", "2", "--output", str(tmp_path / "t.json")]
    assert_clean_failure(run_cli("composite.tune", *not_yaml), ".yaml")
    assert not (tmp_path / "t.yaml").exists()


def test_the_heads_decode_calibration_from_prefill_rows_sees_what_decode_steps_give():
    """composite.tune calibrates the head's graph on the rows of prefill calls: the same hidden
    states, token for token, as the export's decode steps give the head (padding rows only repeat a
    real one); prefill inputs are unchanged and no other shard's decode graph gets anything."""
    import torch

    from composite.lowering.calibration import calibrate
    from composite.manifest import DECODE, PREFILL, method_widths
    from composite.model.default import load_default
    from composite.split.plan import plan_shards
    from composite.split.shard import ShardModule
    from composite.tokenizer import Tokenizer

    loaded = load_default()
    tokenizer = Tokenizer(loaded.tokenizer_path)
    n_layers = loaded.model.args.n_layers
    specs = plan_shards(loaded.model.args, 4, [0, n_layers - 1, 1, 0])
    modules = [ShardModule(loaded.model, spec).eval() for spec in specs]
    methods = method_widths(8)

    def per_token(method, inputs):
        if method == DECODE and len(inputs) == 2:  # (hidden [1, 8, dim], arange(8)): a padded tail repeats
            hidden, rows = inputs
            assert torch.equal(rows, torch.arange(8))
            count = 8
            while count > 1 and torch.equal(hidden[:, count - 1], hidden[:, count - 2]):
                count -= 1
            return [hidden[:, r : r + 1] for r in range(count)]
        return [inputs[0]]

    def captured(**flags):
        seen = {i: {DECODE: [], PREFILL: []} for i in range(len(modules))}

        def recorder(index):
            return lambda method, inputs: seen[index][method].extend(t.clone() for t in per_token(method, inputs))

        consumers = {i: recorder(i) for i in seen}
        held_out = calibrate(
            loaded.model, modules, consumers, methods, 64, {"samples": 5}, tokenizer, tokenizer.bos_id, **flags
        )
        return seen, {i: {m: per_token(m, x) for m, x in h.items()} for i, h in held_out.items()}

    steps, steps_held_out = captured()
    rows, rows_held_out = captured(head_decode_from_rows=True)
    head = len(modules) - 1
    assert len(rows[head][DECODE]) == len(steps[head][DECODE]) == 5 * 8
    for by_step, by_row in zip(steps[head][DECODE], rows[head][DECODE]):
        assert by_row.shape == by_step.shape == (1, 1, loaded.model.args.dim)
        torch.testing.assert_close(by_row, by_step, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rows_held_out[head][DECODE][0], steps_held_out[head][DECODE][0], rtol=1e-4, atol=1e-5)
    for index in range(head):
        assert rows[index][DECODE] == [] and steps[index][DECODE]
        assert len(rows[index][PREFILL]) == len(steps[index][PREFILL]) == 5
        for a, b in zip(rows[index][PREFILL], steps[index][PREFILL]):
            assert torch.equal(a, b)


def test_the_byte_formula_counts_16_bit_weights_and_the_rotation_qnn_keeps_at_16_bits():
    from composite.model.default import DEFAULT_ARGS
    from composite.model.rotation import hidden_rotation_sizes
    from composite.tune.candidates import Candidate, Group, group_bytes, linear_bytes

    n = 64
    assert linear_bytes(n, n, Candidate("qnn", "16a16w"), 32) == 2 * n * n + 8 * n  # weights + per-channel scales
    assert linear_bytes(n, n, Candidate("qnn", "16a4w_block"), 32, qnn_block=16) == n * n // 2 + n * n // 16 + 8 * n
    layers = Group("layers", 1, 0, 1)
    block = Candidate("qnn", "16a4w_block")
    rotation = sum(2 * s * s + 8 * s for s in hidden_rotation_sizes(DEFAULT_ARGS.hidden_dim))
    rotated = group_bytes(layers, block, DEFAULT_ARGS, 32, "hadamard-ffn")[0]
    assert rotated - group_bytes(layers, block, DEFAULT_ARGS, 32)[0] == rotation


def test_qnn_block_size_is_measured_counted_and_written(mixed):
    """--qnn-block-size 16: the 16a4w_block choices measured again in blocks of 16 (not taken from
    the blocks of 32 cached), their bytes counted with twice the block scales, the config exports it."""
    folder, first = mixed
    again, second = tune_again(folder, "blocks_of_16", 1.6, *MIXED, "--qnn-block-size", "16")
    before = {g["group"]: g["choices"] for g in first["groups"]}
    for group in second["groups"]:
        block = group["choices"].get("qnn:16a4w_block")
        if block is None:
            continue
        assert not block["cached"]
        assert block["mb"] > before[group["group"]]["qnn:16a4w_block"]["mb"]
        assert group["choices"]["xnnpack:8da4w"]["mb"] == before[group["group"]]["xnnpack:8da4w"]["mb"]
    assert build_config(str(again / "tuned.yaml"), {}).qnn["block_size"] == 16
