"""A tied table stored once: the 8-bit lookup of the first shard and the 8-bit head of the last read
one int8 matrix from shared_weights.ptd (composite/lowering/shared_table.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from composite import manifest as manifest_schema
from composite import manifest_files
from composite.config import build_config
from composite.deploy import plan_files
from composite.errors import UserError
from composite.lowering.shared_table import DATA_FILE, quantized_as_head, unshared_table_note
from composite.model.checkpoint import load_checkpoint
from composite.model.default import DEFAULT_ARGS
from composite.runtime.chain import ShardChain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from conftest import RUNNER, export, made_once, one_error_line, run_cli, runner_built, runner_tokens

XNNPACK_8DA4W = {"quantize": "8da4w", "group_size": 32}


@pytest.fixture(scope="module")
def tied_table(small_checkpoint) -> torch.Tensor:
    loaded = load_checkpoint(str(small_checkpoint), None)
    assert loaded.args.tie_embeddings
    return loaded.model.tok_embeddings.weight.detach()


@pytest.fixture(scope="module")
def shared_exports(workdir, small_checkpoint):
    """The small tied checkpoint, 8da4w with an 8-bit lookup: in three shards (the first
    embedding-only, so its output is the lookup's) and in one."""

    def make(name: str, **values):
        return made_once(
            workdir / name,
            lambda p: export(
                p, checkpoint=str(small_checkpoint), xnnpack=XNNPACK_8DA4W, embedding_quantize="8,0", **values
            ),
        )

    return make("small_shared_3", shards=3, layers_per_shard=[0, 2, 1]), make("small_shared_1", shards=1)


def test_the_table_is_stored_once_and_both_shards_read_it(shared_exports, tied_table):
    three, one = shared_exports
    manifest = manifest_schema.read(three)
    first, middle, last = manifest["shards"]
    assert first["data"] == last["data"] and first["data"]["file"] == DATA_FILE and "data" not in middle
    assert any("stored once" in note for note in first["notes"])
    qdata, scales = quantized_as_head(tied_table, last["placement"]["options"]["weight_mapping"])
    table = qdata.numpy().tobytes()
    found = {f.name: f.read_bytes().count(table) for f in sorted(three.iterdir()) if f.is_file()}
    assert found == {name: int(name == DATA_FILE) for name in found}, found
    assert (
        manifest_files.stored_bytes(manifest["shards"]) < sum(s["size"] for s in manifest["shards"]) + len(table) + 8192
    )
    # One shard holding both keeps one copy too, inside the same data file.
    whole = manifest_schema.read(one)["shards"][0]
    assert whole["data"]["file"] == DATA_FILE and (one / DATA_FILE).read_bytes().count(table) == 1
    assert one.joinpath(whole["file"]).read_bytes().count(table) == 0

    # The lookup gives the head's rows: int8 times the head's float32 scale, exactly.
    chain = ShardChain(three)
    tokens = torch.tensor([[0, 5, 77, tied_table.shape[0] - 1]])
    rows = torch.cat([chain.runners[0]["decode"]([tokens[:, i : i + 1]])[0] for i in range(tokens.shape[1])], dim=1)
    assert torch.equal(rows[0], qdata[tokens[0]].float() * scales[tokens[0], None])


def test_a_cached_export_brings_back_its_data_file(shared_exports, workdir, small_checkpoint):
    three, _ = shared_exports
    again = export(
        workdir / "small_shared_3_again",
        checkpoint=str(small_checkpoint),
        xnnpack=XNNPACK_8DA4W,
        embedding_quantize="8,0",
        shards=3,
        layers_per_shard=[0, 2, 1],
    )
    shards = manifest_schema.read(again)["shards"]
    assert [s["cache"] for s in shards] == ["hit"] * 3
    assert (again / DATA_FILE).read_bytes() == (three / DATA_FILE).read_bytes()
    assert not list(again.glob("shard_*.ptd"))


def test_shared_table_gives_the_same_tokens_in_any_cut_and_both_runners(shared_exports):
    three, one = shared_exports
    prompt = [1] + torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = generate(ShardChain(three), prompt, 12, Sampler(), keep_logits=True)
    whole = generate(ShardChain(one), prompt, 12, Sampler(), keep_logits=True)
    assert ours.tokens == whole.tokens
    assert max((ours.logits[p] - whole.logits[p]).abs().max().item() for p in ours.logits) < 1e-5
    if runner_built():
        assert runner_tokens(three, prompt, 12) == ours.tokens


def test_untied_rotated_or_4_bit_tables_are_not_shared(workdir, small_checkpoint, default_8da4w_export):
    assert not any("data" in s for s in manifest_schema.read(default_8da4w_export)["shards"])  # untied
    folder = export(
        workdir / "small_4bit_lookup",
        checkpoint=str(small_checkpoint),
        shards=2,
        xnnpack=XNNPACK_8DA4W,
        embedding_quantize="4,32",
    )
    assert not any("data" in s for s in manifest_schema.read(folder)["shards"])
    assert not (folder / DATA_FILE).exists()


def test_an_export_missing_its_data_file_is_refused_in_one_line(shared_exports, tmp_path):
    three, _ = shared_exports
    broken = tmp_path / "broken"
    shutil.copytree(three, broken)
    (broken / DATA_FILE).unlink()
    expected = f"shard 0: {broken / DATA_FILE}, whose weights it reads, is missing"
    result = run_cli("composite.run", "--artifacts", str(broken), "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert result.returncode != 0 and one_error_line(result) == f"error: {expected}"
    if runner_built():
        result = subprocess.run(
            [str(RUNNER), "--artifacts", str(broken), "--prompt_ids", "1,2", "--max_new_tokens", "1"],
            capture_output=True,
            text=True,
        )
        assert result.returncode != 0 and one_error_line(result) == f"error: {expected}"
        # The deploy bundle carries the file once, and refuses an export without it.
        files = plan_files(three, manifest_schema.read(three), RUNNER, "local", "/d", [])
        assert sum(local.name == DATA_FILE for local, _ in files) == 1
        with pytest.raises(UserError, match=f"{DATA_FILE} is missing: the export is incomplete"):
            plan_files(broken, manifest_schema.read(broken), RUNNER, "local", "/d", [])


def test_a_quantized_tied_export_that_keeps_two_tables_says_what_the_flag_saves(small_checkpoint):
    args = load_checkpoint(str(small_checkpoint), None).args
    for lookup, note_expected in (("none", True), ("8,0", False), ("4,32", False)):
        config = build_config(None, {"shards": 2, "xnnpack": XNNPACK_8DA4W, "embedding_quantize": lookup})
        note = unshared_table_note(args, config, config.placements())
        assert (note is not None) == note_expected, (lookup, note)
    table_mb = args.vocab_size * args.dim * 4 / 1e6
    assert "--embedding-quantize 8,0" in note_of(args) and f"{table_mb:.0f} MB less" in note_of(args)
    assert note_of(DEFAULT_ARGS) is None  # untied
    fp32 = build_config(None, {"shards": 2})
    assert unshared_table_note(args, fp32, fp32.placements()) is None  # a float head: nothing to share


def note_of(args):
    config = build_config(None, {"shards": 2, "xnnpack": XNNPACK_8DA4W})
    return unshared_table_note(args, config, config.placements())


def test_shared_table_logits_are_the_eager_models_with_the_table_quantized_the_same_way(
    shared_exports, small_checkpoint
):
    """The eager model quantized by torchao as the export's shards are (8da4w layers, an 8da8w
    head), its lookup the head's int8 rows times their scales: the export's greedy tokens, and its
    logits within XNNPACK's dynamic int8 activations' rounding against torchao's emulation."""
    from composite.lowering.xnnpack import quantize_linears
    from composite.placement_options import DEFAULT_OPTIONS

    three, _ = shared_exports
    model = load_checkpoint(str(small_checkpoint), None).model.eval()
    options = {**DEFAULT_OPTIONS["xnnpack"], **XNNPACK_8DA4W}
    qdata, scales = quantized_as_head(model.tok_embeddings.weight.detach(), options["weight_mapping"])
    eager, _ = quantize_linears(model, options)
    with torch.no_grad():
        eager.tok_embeddings.weight = torch.nn.Parameter(qdata.float() * scales[:, None], requires_grad=False)
    prompt = [1] + torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    ours = generate(ShardChain(three), prompt, 8, Sampler(), keep_logits=True)
    with torch.no_grad():
        expected = eager.forward_full(torch.tensor([prompt + ours.tokens[:-1]]))[0]
    assert torch.argmax(expected[len(prompt) - 1 :], dim=-1).tolist() == ours.tokens
    with torch.no_grad():
        float_table = model.forward_full(torch.tensor([prompt + ours.tokens[:-1]]))[0]  # unquantized, for contrast
    for position, logits in ours.logits.items():
        off = (logits - expected[position]).abs().max()
        assert off < 5e-3 * expected[position].abs().max(), position  # measured 0.18-0.30%
        # ...against 1.1-1.5% from the same model with its float table: the table is the head's.
        assert off < 0.4 * (logits - float_table[position]).abs().max(), position
