"""Run the shards of a split model in order, one method call per shard, with the runner-owned KV
cache: from an export's .pte files (ShardChain) or from the float PyTorch shards (eager_chain, used
to capture calibration inputs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from composite import manifest as manifest_schema
from composite import manifest_files, qnn_host
from composite.errors import UserError
from composite.manifest import VERIFY, takes_logits_index
from composite.model.llama import cache_shapes
from composite.runtime.encoding import Encoding, convert
from composite.runtime.kv_cache import AttentionMask, KVCache
from composite.runtime.shard_call import (
    call_inputs,
    last_row,
    padded_tokens,
    tree_depths,
    tree_visibility,
    write_new_entries,
)

# method name -> callable(list of input tensors) -> list of output tensors, one dict per shard
ShardRunners = dict[str, Callable[[list], list]]


class Chain:
    """forward(method, tokens, pos) runs every shard in order for up to T tokens of one method."""

    def __init__(
        self,
        shards: list[dict],
        runners: list[ShardRunners],
        methods: dict[str, int],
        max_seq_len: int,
        cache: KVCache,
        mask_hidden: float,
        hidden_encodings: list[dict] | None = None,
    ):
        """hidden_encodings: per shard, method -> (encoding of its hidden input, of its hidden
        output), Encoding or None for float32; None: all float32."""
        self.shards, self.runners, self.methods = shards, runners, dict(methods)
        self.hidden_encodings = hidden_encodings or [{m: (None, None) for m in methods} for _ in shards]
        self.max_seq_len, self.cache = max_seq_len, cache
        self.masks = {name: AttentionMask(n, max_seq_len, mask_hidden) for name, n in self.methods.items()}
        self.shard_seconds = [0.0] * len(shards)
        self.kv_write_seconds = 0.0
        self.held_outputs: list[list] = []  # per shard, the outputs of a forward_tree call
        # Called with (shard index, method, inputs) before each shard runs, and with its outputs
        # after (composite.eval --per-shard compares each shard with the float shard this way).
        self.input_observer: Callable[[int, str, list], None] | None = None
        self.output_observer: Callable[[int, str, list], None] | None = None

    def forward(self, method: str, tokens: list[int], pos: int) -> torch.Tensor:
        """Logits [vocab] of the last of `tokens` (at most the method's T) placed at positions pos.."""
        width = self.methods[method]
        count = len(tokens)
        if not 0 < count <= width:
            raise ValueError(f"{method} takes 1..{width} tokens, got {count}")
        if pos + count > self.max_seq_len:
            raise UserError(f"position {pos + count} is beyond max_seq_len {self.max_seq_len}")
        x = self._call(method, tokens, pos, self.masks[method].at(pos), None, count)
        return x[0, -1]  # the head's logits are float32 (the manifest readers check it)

    def forward_tree(self, tokens: list[int], parents: list[int], pos: int) -> torch.Tensor:
        """The verify method on a tree of tokens (runtime/speculate.py) whose root sits at pos:
        -> logits [rows, vocab], every row's. Nothing is written to the cache until commit()."""
        width = self.methods[VERIFY]
        if not 0 < len(tokens) <= width:
            raise ValueError(f"{VERIFY} takes 1..{width} tokens, got {len(tokens)}")
        depths = tree_depths(parents)
        if pos + max(depths) >= self.max_seq_len:
            raise UserError(f"position {pos + max(depths)} is beyond max_seq_len {self.max_seq_len}")
        mask = self.masks[VERIFY].tree(pos, tree_visibility(parents, width))
        positions = torch.tensor([pos + d for d in depths] + [pos] * (width - len(tokens)), dtype=torch.int64)
        x = self._call(VERIFY, tokens, pos, mask, positions, None)
        return x[0, : len(tokens)]

    def commit(self, rows: list[int], pos: int) -> None:
        """The new cache entries of these rows of the last forward_tree call, to slots pos.. ."""
        started = time.perf_counter()
        for shard, outputs in zip(self.shards, self.held_outputs):
            write_new_entries(self.cache, range(*shard["layers"]), outputs, pos, len(rows), rows)
        self.kv_write_seconds += time.perf_counter() - started
        self.held_outputs = []

    def _call(self, method: str, tokens: list[int], pos: int, mask, positions, count: int | None) -> torch.Tensor:
        """Every shard's `method`; count: its first new entries written at pos.., or None to hold
        every shard's outputs for commit()."""
        width = self.methods[method]
        x, encoding = padded_tokens(tokens, width), None
        self.held_outputs = []
        for shard, runners in zip(self.shards, self.runners):
            layers = range(*shard["layers"])
            started = time.perf_counter()  # a hidden-state conversion counts as the shard's time
            wanted, produced = self.hidden_encodings[shard["index"]][method]
            if not shard["has_embedding"]:
                x = convert(x, encoding, wanted)  # only where a quantized shard meets a float one
            caches = [(self.cache.k[layer], self.cache.v[layer]) for layer in layers]
            row = last_row(len(tokens)) if shard["has_head"] and takes_logits_index(method, width) else None
            inputs = call_inputs(x, pos, width, mask, caches, row, positions)
            if self.input_observer is not None:
                self.input_observer(shard["index"], method, inputs)
            outputs = runners[method](inputs)
            self.shard_seconds[shard["index"]] += time.perf_counter() - started
            if self.output_observer is not None:
                self.output_observer(shard["index"], method, outputs)
            x, encoding = outputs[0], produced
            if count is None:
                self.held_outputs.append(outputs)
                continue
            started = time.perf_counter()
            write_new_entries(self.cache, layers, outputs, pos, count)
            self.kv_write_seconds += time.perf_counter() - started
        return x

    def reset(self) -> None:
        self.cache.reset()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the timers (the cache keeps its contents)."""
        self.shard_seconds = [0.0] * len(self.shards)
        self.kv_write_seconds = 0.0


class ShardChain(Chain):
    """The shards of an export, loaded with the ExecuTorch runtime."""

    def __init__(self, folder: Path, verify: bool = False):
        from executorch.runtime import Runtime

        self.folder = Path(folder)
        self.manifest = manifest_schema.read(self.folder)
        manifest_files.check_files(self.folder, self.manifest, verify_sha256=verify)
        shards = self.manifest["shards"]
        shared = weight_shared_shards(self.manifest)
        if shared:
            raise UserError(weight_sharing_refusal(shared))
        if any(shard["placement"]["backend"] == "qnn" for shard in self.manifest["shards"]):
            qnn_host.activate()  # QNN shards run on the x86 HTP simulator: needs the loader path set
        cpu_ops = {op for shard in self.manifest["shards"] for ops in shard.get("cpu_ops", {}).values() for op in ops}
        if any(op.startswith("quantized_decomposed::") for op in cpu_ops):
            # A quantized embedding: ExecuTorch's Python runtime registers those kernels on import.
            import executorch.kernels.quantized  # noqa: F401
        if any(op.startswith("composite::") for op in cpu_ops):
            from composite.ops.attention import load_kernels

            load_kernels()
        check_operators(self.manifest["shards"])
        runtime = Runtime.get()
        started = time.perf_counter()
        runners = []
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            try:
                data = self.folder / shard["data"]["file"] if "data" in shard else None
                program = runtime.load_program(path, data_path=data)
            except (RuntimeError, ValueError) as e:
                raise UserError(f"shard {shard['index']}: ExecuTorch cannot load {path}: {e}") from None
            try:
                manifest_files.check_against_program(program, shard)
            except RuntimeError as e:
                raise UserError(str(e)) from None
            try:
                runners.append({name: program.load_method(name).execute for name in self.manifest["methods"]})
            except (RuntimeError, ValueError) as e:
                raise UserError(f"shard {shard['index']}: ExecuTorch cannot load {path}: {e}") from None
        self.load_seconds = time.perf_counter() - started
        kv = self.manifest["kv_cache"]
        cache = KVCache(self.manifest["model"]["n_layers"], kv["k_shape"], kv["v_shape"], cache_encodings(shards))
        super().__init__(
            shards,
            runners,
            self.manifest["methods"],
            self.manifest["max_seq_len"],
            cache,
            self.manifest["mask"]["hidden"],
            [hidden_encodings(shard) for shard in shards],
        )


def weight_shared_shards(manifest: dict) -> list[int]:
    return [shard["index"] for shard in manifest["shards"] if shard.get("weight_sharing")]


def weight_sharing_refusal(indices: list[int]) -> str:
    """Why a runner on this host cannot load weight-shared QNN shards (composite_runner on x86
    says the same)."""
    one = len(indices) == 1
    which = (
        f"shard {indices[0]} of this export shares"
        if one
        else f"shards {', '.join(map(str, indices))} of this export share"
    )
    return (
        f"{which} QNN weights between decode and prefill, which only a device loads "
        "(the x86 HTP simulator cannot); re-export with --no-weight-sharing to run it on this host"
    )


def check_operators(shards: list[dict]) -> None:
    """Every operator a shard runs on ExecuTorch's CPU kernels is registered, or one line names it
    (composite_runner checks the same)."""
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    registered = set(_get_operator_names())
    for shard in shards:
        for op in sorted({op for ops in shard.get("cpu_ops", {}).values() for op in ops}):
            if op not in registered:
                raise UserError(f"shard {shard['index']} runs operator {op}, which this runtime has no kernel for")


def cache_encodings(shards: list[dict]) -> list[tuple]:
    """Per layer, (k, v) encodings of its cache: as the shard holding the layer takes it in."""
    encodings = []
    for shard in shards:
        inputs = {t["name"]: t for t in shard["io"][manifest_schema.DECODE]["inputs"]}
        for layer in range(*shard["layers"]):
            encodings.append((Encoding.of(inputs[f"k_cache.{layer}"]), Encoding.of(inputs[f"v_cache.{layer}"])))
    return encodings


def hidden_encodings(shard: dict) -> dict:
    """method -> (encoding of the shard's hidden input, of its hidden output)."""
    return {
        method: (
            None if shard["has_embedding"] else Encoding.of(io["inputs"][0]),
            None if shard["has_head"] else Encoding.of(io["outputs"][0]),
        )
        for method, io in shard["io"].items()
    }


def eager_chain(model, shard_modules: list, methods: dict[str, int], max_seq_len: int) -> Chain:
    """The float PyTorch shards chained exactly as the runners chain the exported ones."""

    def runner(module):
        def run(inputs):
            with torch.no_grad():
                return list(module(*inputs))

        return run

    shards = [
        {
            "index": m.spec.index,
            "layers": [m.spec.layer_start, m.spec.layer_end],
            "has_embedding": m.spec.has_embedding,
            "has_head": m.spec.has_head,
        }
        for m in shard_modules
    ]
    runners = [{name: runner(m) for name in methods} for m in shard_modules]
    k_shape, v_shape = cache_shapes(model.args, max_seq_len)
    cache = KVCache(model.args.n_layers, k_shape, v_shape)
    return Chain(shards, runners, methods, max_seq_len, cache, manifest_schema.MASK_HIDDEN)
