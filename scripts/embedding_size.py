"""On demand (not CI): how much a quantized embedding saves on a stories110M-shaped model.

Exports the benchmark's random-weight stories110M checkpoint (768 dim, 12 layers, vocab 32000) as
one 8da4w XNNPACK shard, with and without --embedding-quantize, prints the sizes and checks the
greedy tokens of each against the same quantized model run in eager PyTorch (the shard module
quantized as the export quantizes it, chained as the runners chain it).

Random weights give near-tied logits: XNNPACK's integer GEMMs and torchao's eager ops round
differently, and one flipped activation quantum can flip such a tie. A trained model's argmax has a
margin; so the checked model gets one too: the benchmark's weights with a planted next-token map
added to the head (token t's embedding row is added to the head row of token perm[t]). The script
prints the smallest top-1 margin it saw and the largest logit difference from eager, so the
margin is seen to be what keeps the tokens equal, not something that hides a wrong model.
Usage: python scripts/embedding_size.py [--work DIR] [--settings 4,32 8,0]"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from composite.bench.workload import DIMS, write_workload
from composite.config import build_config
from composite.export import run_export
from composite.lowering.embedding import QuantizedEmbedding
from composite.lowering.xnnpack import quantize_linears, xnnpack_form
from composite.manifest import method_widths
from composite.manifest_files import stored_bytes
from composite.model.checkpoint import load_checkpoint
from composite.placement_options import DEFAULT_OPTIONS
from composite.runtime.chain import ShardChain, eager_chain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule

MAX_SEQ_LEN, PREFILL_LEN, GROUP = 256, 32, 32
PLANT_SEED = 7


def with_planted_head(paths: dict, folder: Path) -> dict:
    """A copy of the workload whose head also maps each token's embedding to a fixed next token."""
    folder.mkdir(parents=True, exist_ok=True)
    planted = {name: folder / path.name for name, path in paths.items()}
    if planted["consolidated.00.pth"].exists():
        return planted
    for name, path in paths.items():
        if name != "consolidated.00.pth":
            shutil.copyfile(path, planted[name])
    state = torch.load(paths["consolidated.00.pth"])
    embedding = state["tok_embeddings.weight"]
    next_token = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(PLANT_SEED))
    head = state["output.weight"].clone()
    head[next_token] += embedding / embedding.norm(dim=1, keepdim=True)
    state["output.weight"] = head
    torch.save(state, planted["consolidated.00.pth"])
    return planted


XNNPACK = {"quantize": "8da4w", "group_size": GROUP}


def export(paths: dict, out: Path, embedding_quantize: str) -> dict:
    if not (out / "manifest.json").exists():
        values = {
            "checkpoint": str(paths["consolidated.00.pth"]),
            "params": str(paths["params.json"]),
            "tokenizer": str(paths["tokenizer.model"]),
            "max_seq_len": MAX_SEQ_LEN,
            "prefill_len": PREFILL_LEN,
            "xnnpack": XNNPACK,
            "embedding_quantize": embedding_quantize,
            "output": str(out),
        }
        run_export(build_config(None, values))
    return json.loads((out / "manifest.json").read_text())


def eager_generation(paths: dict, embedding_quantize: str, prompt: list[int], new_tokens: int):
    model = load_checkpoint(str(paths["consolidated.00.pth"]), str(paths["params.json"])).model
    shard = ShardModule(model, plan_shards(model.args, 1, None)[0]).eval()
    if embedding_quantize != "none":
        bits, group = (int(x) for x in embedding_quantize.split(","))
        shard.tok_embeddings = QuantizedEmbedding(model.tok_embeddings.weight, bits, group)
    module, _ = quantize_linears(xnnpack_form(shard), {**DEFAULT_OPTIONS["xnnpack"], **XNNPACK})
    chain = eager_chain(model, [module], method_widths(PREFILL_LEN), MAX_SEQ_LEN)
    return generate(chain, prompt, new_tokens, Sampler(), keep_logits=True)


def margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(Path.home() / ".cache/composite/embedding_size"))
    p.add_argument("--settings", nargs="+", default=["4,32", "8,0"])
    args = p.parse_args()
    work = Path(args.work)
    paths = with_planted_head(write_workload(DIMS["stories110m"], work / "checkpoint"), work / "planted")
    prompt = list(range(1, 65))
    base = export(paths, work / "8da4w", "none")
    base_size = stored_bytes(base["shards"])
    print(f"8da4w alone: {base_size / 1e6:.1f} MB")
    for setting in args.settings:
        manifest = export(paths, work / f"8da4w_embedding_{setting.replace(',', '_')}", setting)
        size = stored_bytes(manifest["shards"])
        ours = generate(
            ShardChain(work / f"8da4w_embedding_{setting.replace(',', '_')}"), prompt, 32, Sampler(), keep_logits=True
        )
        eager = eager_generation(paths, setting, prompt, 32)
        same = ours.tokens == eager.tokens
        shared = sorted(set(ours.logits) & set(eager.logits))
        smallest = min(margin(eager.logits[p]) for p in shared)
        largest = max(float((ours.logits[p] - eager.logits[p]).abs().max()) for p in shared)
        print(
            f"8da4w + embedding {setting}: {size / 1e6:.1f} MB = {size / base_size:.3f}x; "
            f"{'; '.join(manifest['shards'][0]['notes'])}; greedy tokens equal eager: {same} "
            f"(smallest eager top-1 margin {smallest:.3f}, largest logit difference {largest:.3f})"
        )
        if not same:
            print(f"  ours  {ours.tokens}\n  eager {eager.tokens}", file=sys.stderr)


if __name__ == "__main__":
    main()
