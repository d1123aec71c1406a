"""Load the shards of an export with the ExecuTorch runtime and run them as one model."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from composite import manifest as manifest_schema
from composite.errors import UserError
from composite.runtime.kv_cache import AttentionMask, KVCache


class ShardChain:
    """forward(tokens, pos) runs every shard in order for up to T tokens of one method."""

    def __init__(self, folder: Path, verify: bool = False):
        from executorch.runtime import Runtime

        self.folder = Path(folder)
        self.manifest = manifest_schema.read(self.folder)
        manifest_schema.check_files(self.folder, self.manifest, verify_sha256=verify)
        self.max_seq_len = self.manifest["max_seq_len"]
        self.methods = dict(self.manifest["methods"])
        self.shards = self.manifest["shards"]
        self.cache = KVCache(self.manifest)
        hidden = self.manifest["mask"]["hidden"]
        self.masks = {name: AttentionMask(n, self.max_seq_len, hidden) for name, n in self.methods.items()}
        self.shard_seconds = [0.0] * len(self.shards)
        runtime = Runtime.get()
        started = time.perf_counter()
        self.loaded = []
        for shard in self.shards:
            path = self.folder / shard["file"]
            try:
                program = runtime.load_program(path)
                self.loaded.append({name: program.load_method(name) for name in self.methods})
            except (RuntimeError, ValueError) as e:
                raise UserError(f"shard {shard['index']}: ExecuTorch cannot load {path}: {e}") from None
        self.load_seconds = time.perf_counter() - started

    def forward(self, method: str, tokens: list[int], pos: int) -> torch.Tensor:
        """Logits [count, vocab] for `tokens` (at most the method's T) placed at positions pos.."""
        width = self.methods[method]
        count = len(tokens)
        if not 0 < count <= width:
            raise ValueError(f"{method} takes 1..{width} tokens, got {count}")
        if pos + count > self.max_seq_len:
            raise UserError(f"position {pos + count} is beyond max_seq_len {self.max_seq_len}")
        padded = torch.tensor([tokens + [0] * (width - count)], dtype=torch.int64)
        positions = torch.arange(pos, pos + width, dtype=torch.int64)
        mask = self.masks[method].at(pos)
        x = padded
        for shard, methods in zip(self.shards, self.loaded):
            first, end = shard["layers"]
            inputs = [x]
            if end > first:
                inputs += [positions, mask]
                for layer in range(first, end):
                    inputs += [self.cache.k[layer], self.cache.v[layer]]
            started = time.perf_counter()
            outputs = methods[method].execute(inputs)
            self.shard_seconds[shard["index"]] += time.perf_counter() - started
            x = outputs[0]
            for i, layer in enumerate(range(first, end)):
                self.cache.write(layer, outputs[1 + 2 * i], outputs[2 + 2 * i], pos, count)
        return x[0, :count]

    def reset(self) -> None:
        self.cache.reset()
        self.shard_seconds = [0.0] * len(self.shards)
