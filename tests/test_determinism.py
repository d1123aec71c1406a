"""Same inputs, same outputs: an export repeated gives byte-identical XNNPACK shards, and a seeded
sampling run repeated gives the same tokens. (Quantized QNN shards lowered twice:
tests/test_qnn_native_io.py; what QNN's compiler leaves to chance: docs/placement.md.)"""

from __future__ import annotations

import json

from composite import manifest as manifest_schema
from conftest import export, run_cli


def test_exporting_twice_gives_identical_xnnpack_shards(workdir, default_exports):
    again = export(workdir / "default_3_again", cached=False, shards=3)
    first, second = manifest_schema.read(default_exports[3]), manifest_schema.read(again)
    assert [s["sha256"] for s in first["shards"]] == [s["sha256"] for s in second["shards"]]
    assert first["tokenizer"]["sha256"] == second["tokenizer"]["sha256"]
    assert first["export_id"] != second["export_id"]


def test_seeded_sampling_repeats(default_exports):
    def sample(seed: str) -> list[int]:
        result = run_cli(
            "composite.run",
            "--artifacts",
            str(default_exports[3]),
            "--prompt",
            "Mia ran",
            "--max-new-tokens",
            "24",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--seed",
            seed,
            "--json",
            check=True,
        )
        return json.loads(result.stdout)["tokens"]

    first = sample("11")
    assert sample("11") == first
    assert sample("12") != first


def test_shared_node_provenance_keeps_provenance_and_bytes():
    """Lowering shares each node's provenance chain rather than deep-copying it at every pass
    (composite.lowering.upstream_patches.provenance_shared): the chains and the .pte bytes are the same."""
    import copy

    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch.fx.traceback import NodeSource

    from composite.lowering.upstream_patches import provenance_shared

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return torch.nn.functional.silu(self.up(torch.nn.functional.layer_norm(x, (16,)))) @ self.down.weight.T

    def without_ids(source: dict) -> dict:  # graph_id is id(graph): an address, other each run
        return {**source, "graph_id": None, "from_node": [without_ids(item) for item in source["from_node"]]}

    def lowered() -> tuple[bytes, list]:
        exported = torch.export.export(Block().eval(), (torch.randn(2, 16),), strict=False)
        edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
        chains = [
            [without_ids(source.to_dict()) for source in node.meta.get("from_node", [])]
            for method in edge.methods
            for module in edge.exported_program(method).graph_module.modules()
            if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes
        ]
        return edge.to_executorch().buffer, chains

    with provenance_shared():
        shared_bytes, shared_chains = lowered()
        source = NodeSource(None)
        assert copy.deepcopy(source) is source
    source = NodeSource(None)
    assert copy.deepcopy(source) is not source  # torch's own behaviour once the lowering is done
    copied_bytes, copied_chains = lowered()

    def depth(chain):
        return max((1 + depth(item["from_node"]) for item in chain), default=0)

    assert max(depth(chain) for chain in copied_chains) >= 2  # chains that passes have built on
    assert shared_chains == copied_chains
    assert shared_bytes == copied_bytes
