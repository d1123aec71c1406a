"""composite.tune's cache of measurements: one JSON file per model, text and settings (the key is
everything a measured KLD depends on), so that another budget or a stopped run costs nothing that
was measured already (~/.cache/composite/tune, --cache-dir, --no-cache)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from composite import shard_cache
from composite.manifest_files import sha256_file
from composite.manifest_write import versions


class ResultCache:
    """Measured sensitivities, one JSON file per model, text and settings; None folder: off."""

    def __init__(self, folder: Path | None, common: dict):
        self.path = folder / f"{shard_cache.key_of(common)}.json" if folder is not None else None
        self.results: dict = {}
        if self.path is not None and self.path.exists():
            try:
                self.results = json.loads(self.path.read_text())
            except (OSError, ValueError):
                print(f"warning: ignoring an unreadable tune cache file {self.path}", file=sys.stderr)

    def get(self, key: str) -> dict | None:
        return self.results.get(key)

    def put(self, key: str, value: dict) -> None:
        self.results[key] = value
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(self.results, indent=1, sort_keys=True))
        scratch.replace(self.path)


def cache_folder(args) -> Path | None:
    if args.no_cache:
        return None
    if args.cache_dir:
        return Path(args.cache_dir)
    return Path.home() / ".cache" / "composite" / "tune"


def measurement_settings(args, inputs, model, rotation: str) -> dict:
    """Everything a measured KLD depends on: the measurement cache's key."""
    return {
        "versions": versions(),
        # the code that measures: the command line (__main__.py) parses and prints, output.py and
        # verify.py write and check what was measured
        "source": shard_cache.source_fingerprint(excluded=("bench", "__main__.py", "output.py", "verify.py")),
        "model": shard_cache.tensors_digest(model),
        "tokenizer": sha256_file(inputs.tokenizer.path),
        "bos": inputs.bos,
        "text": hashlib.sha256(inputs.text.encode()).hexdigest(),
        "ctx": args.ctx or args.max_seq_len,
        "limit_tokens": args.limit_tokens,
        "score": args.score,
        "max_seq_len": args.max_seq_len,
        "prefill_len": args.prefill_len,
        "group_size": args.group_size,
        "soc": args.soc,
        "qnn_block_size": args.qnn_block_size,
        "rotate": rotation,
        "groups": [[g.kind, g.layer_start, g.layer_end] for g in inputs.groups],
    }
