"""On demand (not CI): how much a quantized embedding saves on a stories110M-shaped model.

Exports the benchmark's random-weight stories110M checkpoint (768 dim, 12 layers, vocab 32000) as
one 8da4w XNNPACK shard, with and without --embedding-quantize, prints the sizes and checks the
greedy tokens of each against the same quantized model run in eager PyTorch (the shard module
quantized as the export quantizes it, chained as the runners chain it).
Usage: python scripts/embedding_size.py [--work DIR] [--settings 4,32 8,0]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from composite.bench.workload import DIMS, write_workload
from composite.config import build_config
from composite.export import run_export
from composite.lowering.embedding import QuantizedEmbedding
from composite.lowering.xnnpack import quantize_8da4w, xnnpack_form
from composite.manifest import DECODE, PREFILL
from composite.model.checkpoint import load_checkpoint
from composite.runtime.chain import ShardChain, eager_chain
from composite.runtime.generate import generate
from composite.runtime.sampler import Sampler
from composite.split.plan import plan_shards
from composite.split.shard import ShardModule

MAX_SEQ_LEN, PREFILL_LEN, GROUP = 256, 32, 32


def export(paths: dict, out: Path, embedding_quantize: str) -> dict:
    if not (out / "manifest.json").exists():
        values = {
            "checkpoint": str(paths["consolidated.00.pth"]),
            "params": str(paths["params.json"]),
            "tokenizer": str(paths["tokenizer.model"]),
            "max_seq_len": MAX_SEQ_LEN,
            "prefill_len": PREFILL_LEN,
            "xnnpack": {"quantize": "8da4w", "group_size": GROUP},
            "embedding_quantize": embedding_quantize,
            "output": str(out),
        }
        run_export(build_config(None, values))
    return json.loads((out / "manifest.json").read_text())


def eager_tokens(paths: dict, embedding_quantize: str, prompt: list[int], new_tokens: int) -> list[int]:
    model = load_checkpoint(str(paths["consolidated.00.pth"]), str(paths["params.json"])).model
    shard = ShardModule(model, plan_shards(model.args, 1, None)[0]).eval()
    if embedding_quantize != "none":
        bits, group = (int(x) for x in embedding_quantize.split(","))
        shard.tok_embeddings = QuantizedEmbedding(model.tok_embeddings.weight, bits, group)
    module, _ = quantize_8da4w(xnnpack_form(shard), GROUP)
    chain = eager_chain(model, [module], {DECODE: 1, PREFILL: PREFILL_LEN}, MAX_SEQ_LEN)
    return generate(chain, prompt, new_tokens, Sampler()).tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(Path.home() / ".cache/composite/embedding_size"))
    p.add_argument("--settings", nargs="+", default=["4,32", "8,0"])
    args = p.parse_args()
    work = Path(args.work)
    paths = write_workload(DIMS["stories110m"], work / "checkpoint")
    prompt = list(range(1, 65))
    base = export(paths, work / "8da4w", "none")
    base_size = sum(s["size"] for s in base["shards"])
    print(f"8da4w alone: {base_size / 1e6:.1f} MB")
    for setting in args.settings:
        manifest = export(paths, work / f"8da4w_embedding_{setting.replace(',', '_')}", setting)
        size = sum(s["size"] for s in manifest["shards"])
        ours = generate(ShardChain(work / f"8da4w_embedding_{setting.replace(',', '_')}"), prompt, 32, Sampler()).tokens
        eager = eager_tokens(paths, setting, prompt, 32)
        print(
            f"8da4w + embedding {setting}: {size / 1e6:.1f} MB = {size / base_size:.3f}x; "
            f"{'; '.join(manifest['shards'][0]['notes'])}; greedy tokens equal eager: {ours == eager}"
        )
        if ours != eager:
            print(f"  ours  {ours}\n  eager {eager}", file=sys.stderr)


if __name__ == "__main__":
    main()
