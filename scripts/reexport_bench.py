"""Cold export against a re-export after one shard's placement changed, on demand:

    python scripts/reexport_bench.py --config configs/smollm2.yaml --no-weight-sharing \\
        --change '5={backend: xnnpack, quantize: 8da8w}'

1. exports the config into an empty shard cache (timed: the cold export);
2. exports it again with the change (timed: the re-export, which takes the other shards from the cache);
3. exports the changed config once more with --no-cache (a cold export of it) and compares: the
   re-export's shards must be byte-identical to it where the lowering is deterministic (XNNPACK,
   portable; QNN context binaries differ between compilations, so QNN shards are compared with the
   first export's file they were taken from), and both must generate the same tokens.
Prints a markdown table. Everything goes into a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROMPT_IDS = "1,17,230,45,99,301,7"


def export(config: Path, output: Path, cache: Path, *flags: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "composite.export", "--config", str(config), "--output", str(output), *flags],
        cwd=REPO,
        env={**os.environ, "COMPOSITE_CACHE": str(cache)},
        check=True,
    )
    return time.perf_counter() - started


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def tokens(folder: Path) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-m", "composite.run", "--artifacts", str(folder), "--prompt-ids", PROMPT_IDS]
        + ["--max-new-tokens", "16", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)["tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--change", required=True, help="INDEX=placement item, YAML (e.g. '5=xnnpack')")
    p.add_argument("--no-weight-sharing", action="store_true")
    args = p.parse_args()
    index, _, item = args.change.partition("=")
    data = yaml.safe_load(Path(args.config).read_text())
    placement = data.get("placement", "xnnpack")
    shards = data.get("shards") or len(data.get("layers_per_shard") or [1])
    placement = list(placement) if isinstance(placement, list) else [placement] * shards
    placement[int(index)] = yaml.safe_load(item)
    flags = ["--no-weight-sharing"] if args.no_weight_sharing else []
    with tempfile.TemporaryDirectory(prefix="reexport-") as scratch:
        scratch = Path(scratch)
        cache = scratch / "cache"
        changed_config = scratch / "changed.yaml"
        changed_config.write_text(yaml.safe_dump({**data, "placement": placement}))
        cold = export(Path(args.config), scratch / "cold", cache, *flags)
        again = export(changed_config, scratch / "changed", cache, *flags)
        reference = export(changed_config, scratch / "reference", cache, *flags, "--no-cache")
        first, changed, fresh = (manifest(scratch / n) for n in ("cold", "changed", "reference"))
        print(
            f"\ncold export {cold:.1f} s, re-export after changing shard {index} {again:.1f} s "
            f"({again / cold:.2f} of the cold export); cold export of the changed config {reference:.1f} s\n"
        )
        print("| shard | backend | re-export | same bytes as |")
        print("|---|---|---|---|")
        for s, c, f in zip(first["shards"], changed["shards"], fresh["shards"]):
            backend = c["placement"]["backend"]
            if c["cache"] == "hit":
                same = "the cold export" if c["sha256"] == s["sha256"] else "**neither**"
                if backend != "qnn":
                    same += ", a fresh lowering" if c["sha256"] == f["sha256"] else ", **not a fresh lowering**"
            else:
                same = "a fresh lowering" if c["sha256"] == f["sha256"] else "(QNN: compiled anew)"
            print(f"| {c['index']} | {backend} | {c['cache']} | {same} |")
        same_tokens = tokens(scratch / "changed") == tokens(scratch / "reference")
        print(
            f"\ngreedy tokens of the re-export and the cold export of the changed config: "
            f"{'equal' if same_tokens else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
