"""A tied embedding table stored once: the lookup in the first shard and the head in the last read
the same 8-bit matrix from one data file beside the shards (ExecuTorch's named data, a .ptd).

With tied embeddings the table is the head's weight too. The head of a quantized XNNPACK shard
has 8-bit weights with one scale per output row (8da8w); an 8-bit lookup table with one scale per
row (`embedding_quantize: "8,0"`) is the same matrix in the same format, so when both are asked
for, the lookup is quantized exactly as the head is (torchao, the head's weight mapping) and both
programs keep the int8 matrix outside the .pte, tagged for the export's data file:
- the lookup's table as an external constant of its program (ExecuTorch's `external_constants`,
  keyed by its name);
- the head's weight as XNNPACK's named data (the delegate's `delegate_constant_tag`, keyed by the
  sha256 of its bytes).
Each lowering job writes its program's data beside its .pte (shard_NN.ptd); the export then
merges them into one DATA_FILE (data_files.py), where ExecuTorch's named-data store keeps equal
bytes once (as it does within one program, where one shard holds both), and every shard that
reads it names it in the manifest (`data`). Both runners load each such shard with that file as
its data map.

Not shared (each shard keeps its own copy): untied checkpoints, a lookup or head in
another format (4-bit, float, an fp16 or QNN head), and a rotated
residual stream (the head then carries the final norm's scale, so it is no longer the table).
"""

from __future__ import annotations

import dataclasses

import torch

from composite.errors import UserError
from composite.units import MB

TAG = "shared_weights"  # the external-data tag both programs use; the merged file is TAG + ".ptd"
DATA_FILE = TAG + ".ptd"


def head_mapping(args, config, placements) -> str | None:
    """The head's torchao weight mapping when the export stores the tied table once, else None."""
    bits_group = config.embedding_bits_and_group()
    head = placements[-1]
    if not args.tie_embeddings or bits_group != (8, 0) or config.rotation() != "none":
        return None
    if placements[0].options.get("dtype", "fp32") != "fp32":
        return None  # an fp16 lookup gives float16 rows from float16 scales
    options = head.options
    if head.backend != "xnnpack" or options["quantize"] == "none" or options["dtype"] != "fp32":
        return None
    scheme = options["quantize"] if options["head_quantize"] == "same" else options["head_quantize"]
    return options["weight_mapping"] if scheme == "8da8w" else None


def unshared_table_note(args, config, placements) -> str | None:
    """What the user would save, in one line, where a tied model's export keeps a float32 lookup
    table beside the head's 8-bit one though embedding_quantize 8,0 would store the table once."""
    if not args.tie_embeddings or config.embedding_bits_and_group() is not None:
        return None
    if head_mapping(args, dataclasses.replace(config, embedding_quantize="8,0"), placements) is None:
        return None
    table_mb = args.vocab_size * args.dim * 4 / MB
    return (
        f"note: this tied model's lookup keeps its own {table_mb:.0f} MB float32 table beside the head's 8-bit "
        f"one; --embedding-quantize 8,0 stores the table once, in 8 bits ({table_mb:.0f} MB less)"
    )


def quantized_as_head(table: torch.Tensor, mapping: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [vocab, dim], float32 scales [vocab]) of `table` quantized as an XNNPACK 8da8w head
    with `mapping` quantizes its weight: the same function on the same matrix, so the same bytes."""
    from composite.lowering import torchao_weights

    head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
    head.weight = torch.nn.Parameter(table.detach(), requires_grad=False)
    torchao_weights.quantize_by_rows(head, torchao_weights.scheme_config("8da8w", 0, mapping)[0])
    weight = head.weight
    if bool((weight.zero_point != 0).any()):
        raise UserError(
            f"weight_mapping {mapping} gives the head zero points; the shared table needs symmetric weights"
        )
    return weight.qdata, weight.scale.reshape(-1).float()


def tag_lookup(node: torch.fx.Node) -> str | None:
    """ExecuTorch's external_constants: the lookup's table goes to the shared data file."""
    return TAG if node.name.endswith("tok_embeddings_weight") else None


def tag_head(graph_module: torch.fx.GraphModule):
    """A pass over an edge program before XNNPACK takes it: the head's int8 weight goes to the
    shared data file (XNNPACK stores its weights as named data, keyed by their sha256)."""
    from executorch.exir.pass_base import PassResult

    tagged = False
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        is_int8 = getattr(value, "dtype", None) == torch.int8 and value.dim() == 2
        if node.op == "placeholder" and node.name.startswith("p_output_") and is_int8:
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = TAG
            tagged = True
    return PassResult(graph_module, tagged)
