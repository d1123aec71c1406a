"""python -m composite.export: cut a LLaMA into N shards and lower each to its own .pte.

parse (flags over the YAML, config.py) -> plan (checkpoint, shards, placements) -> lower (each
shard with its backend; QNN shards also together: lowering/qnn.py) -> write (a staging folder
renamed into place when complete: staging.py; the manifest: manifest.py).
"""

from __future__ import annotations

import sys

from composite import quiet

if __name__ == "__main__" and "--verbose" not in sys.argv:
    # Run as the CLI: keep library chatter (torchao logs while ExecuTorch imports it) out before
    # those libraries load. Importing this module elsewhere changes nothing.
    quiet.silence_library_noise()

import argparse
import errno
import hashlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

import composite
from composite import chat_template, qnn_host, shard_cache, staging
from composite import manifest as manifest_schema
from composite.config import QNN_PRECISIONS, ROTATIONS, ExportConfig, Placement, check_group_sizes, config_from_flags
from composite.errors import UserError, exits_cleanly
from composite.lowering import LoweredShard, embedding, finish, lower_shard
from composite.lowering.calibration import calibration_text
from composite.lowering.worker import ForkedWorker, split_work
from composite.manifest import DECODE, PREFILL
from composite.model.checkpoint import load_checkpoint
from composite.model.llama import cache_shapes
from composite.model.loaded import LoadedModel
from composite.model.rotation import rotate
from composite.shard_cache import ShardCache
from composite.split.plan import ShardSpec, plan_shards
from composite.split.shard import ShardModule, shard_io
from composite.tokenizer import Tokenizer, tokenizer_for_model


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.export", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (flags below override it)")
    p.add_argument("--shards", type=int, help="number of shards (default 1)")
    p.add_argument("--placement", help="backend per shard, comma separated (xnnpack,portable,qnn), or one for all")
    p.add_argument("--layers-per-shard", help="explicit decoder layers per shard, comma separated, e.g. 0,3,3,0")
    p.add_argument(
        "--checkpoint",
        help="Meta .pth/.pt (+ params.json), Hugging Face folder, or llama GGUF file; none = embedded default",
    )
    p.add_argument("--params", help="params.json for a Meta checkpoint")
    p.add_argument("--tokenizer", help="tokenizer.model (SentencePiece or tiktoken) or tokenizer.json")
    p.add_argument(
        "--chat-template",
        help="Jinja chat template file for --chat, instead of the tokenizer's own (tokenizer_config.json, "
        "chat_template.jinja, GGUF tokenizer.chat_template)",
    )
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default 512)")
    p.add_argument("--prefill-len", type=int, help="tokens per prefill call (default 64)")
    p.add_argument(
        "--quantize",
        choices=["none", "8da4w", "8da8w"],
        help="XNNPACK linears: 8-bit dynamic activations with int4 grouped (8da4w) or int8 per-channel (8da8w) weights",
    )
    p.add_argument("--group-size", type=int, help="8da4w group size (default 32)")
    p.add_argument(
        "--head-quantize",
        choices=["8da8w", "same", "none"],
        help="a quantized shard's head: 8-bit per-channel weights (8da8w, the default), as the other linears "
        "(same), or float (none)",
    )
    p.add_argument(
        "--weight-mapping",
        choices=["symmetric_no_clipping_err", "symmetric"],
        help="how quantized weights get their scales: no weight clipped (the default), or torchao's symmetric",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "fp16"],
        help="XNNPACK shards' float dtype: weights, activations, hidden state and KV cache (default fp32)",
    )
    p.add_argument(
        "--attention",
        choices=["graph", "kernel"],
        help="XNNPACK shards' decode attention: composite::attention over the valid cache slots (kernel, the "
        "default), or masked matmuls over every slot in the graph",
    )
    p.add_argument(
        "--embedding-quantize",
        help="quantize the embedding table: BITS,GROUP, e.g. 8,0 (8-bit, a scale per row) or 4,32 (default none)",
    )
    p.add_argument(
        "--rotate",
        choices=["auto", *ROTATIONS],
        help="rotate the residual stream by a randomized Hadamard matrix folded into the weights (the same model "
        "in float, easier to quantize); hadamard-ffn also rotates each feed-forward's hidden activation at run "
        "time; auto (the default): when some shard has 8-bit weights (8da8w, 16a8w, 8a8w, 16a16w) and none "
        "4-bit ones (8da4w, 16a4w), hadamard-ffn if those shards are all XNNPACK ones, else hadamard",
    )
    p.add_argument(
        "--qnn-precision",
        choices=QNN_PRECISIONS,
        help="QNN shards' precision, where a shard's own entry does not set one (default fp16)",
    )
    p.add_argument(
        "--no-weight-sharing",
        action="store_true",
        help="QNN shards keep a copy of their weights per method: the host twin, which the x86 HTP simulator loads",
    )
    p.add_argument("--output", help="artifacts folder (default ./artifacts)")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="lower every shard and store none (default: reuse and store lowered shards in ~/.cache/composite/shards, "
        "or COMPOSITE_CACHE; COMPOSITE_CACHE=off is --no-cache)",
    )
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def lower_all(
    loaded: LoadedModel,
    specs: list[ShardSpec],
    placements: list[Placement],
    config: ExportConfig,
    tokenizer: Tokenizer | None,
    folder: Path,
    bos: int | None = None,
    cache: ShardCache | None = None,
) -> tuple[list[dict], dict | None]:
    """Lower every shard into `folder`, or take it from the cache; -> (manifest entries, the
    manifest's qnn summary). bos: the id the runners put before a text prompt, which calibration
    puts before its text too."""
    model = loaded.model
    methods = {DECODE: 1, PREFILL: config.prefill_len}
    io = [{m: shard_io(model.args, spec, n, config.max_seq_len) for m, n in methods.items()} for spec in specs]
    names = [{m: ([t.name for t in i], [t.name for t in o]) for m, (i, o) in shard.items()} for shard in io]
    examples = [{m: tuple(t.example() for t in inputs) for m, (inputs, _) in shard.items()} for shard in io]
    modules = [ShardModule(model, spec).eval() for spec in specs]
    keys = cache_keys(model, modules, specs, placements, config, tokenizer, bos) if cache is not None else {}
    embedding_notes = []
    if config.embedding_bits_and_group() is not None:
        bits, group = config.embedding_bits_and_group()
        embedding_notes = embedding.quantize(modules[0], bits, group, specs[-1].index, model.args.tie_embeddings)
    entries: dict[int, dict] = {}
    baked_spill_fill = {}  # cached QNN shard -> the shared spill-fill size it was compiled with
    for spec in specs:
        started = time.perf_counter()
        hit = cache.get(keys[spec.index], folder, shard_file(spec)) if cache is not None else None
        if hit is not None:
            baked_spill_fill[spec.index] = hit.pop(SHARED_SPILL_FILL, 0)
            entries[spec.index] = {
                "index": spec.index,
                "file": shard_file(spec),
                **hit,
                "export_seconds": round(time.perf_counter() - started, 2),
                "cache": "hit",
            }
    missed = [(spec, placement) for spec, placement in zip(specs, placements) if spec.index not in entries]
    qnn_missed = [spec.index for spec, placement in missed if placement.backend == "qnn"]
    qnn_cached = [i for i, p in enumerate(placements) if p.backend == "qnn" and i in entries]

    def lower_plain(index: int) -> dict:
        """An XNNPACK or portable shard, lowered, written and stored; its manifest entry."""
        started = time.perf_counter()
        spec, placement = specs[index], placements[index]
        module, notes, encodings = lower_shard(modules[index], examples[index], names[index], placement)
        lowered = finish(module, notes + (embedding_notes if spec.has_embedding else []))
        entry = write_shard(folder, spec, placement, lowered, io[index], time.perf_counter() - started, encodings)
        store(cache, keys, entry, folder)
        return entry

    plain = {spec.index: lowering_work(spec, placement) for spec, placement in missed if placement.backend != "qnn"}
    qnn_work = sum(lowering_work(specs[i], placements[i]) for i in qnn_missed)
    worker = None
    if parallel_lowering() and len(plain) + bool(qnn_missed) >= 2:
        _, theirs = split_work(plain, qnn_work)
        worker = ForkedWorker(lower_plain, theirs)
        print(f"note: shards {', '.join(map(str, theirs))} are lowered in a second process", file=sys.stderr)
        missed = [(spec, placement) for spec, placement in missed if spec.index not in theirs]
    seconds = {}
    try:
        qnn = make_qnn_shards(qnn_missed, model, modules, examples, names, placements, config, tokenizer, bos)
        for spec, placement in tqdm(missed, desc="lowering shards", unit="shard", file=sys.stderr, disable=not missed):
            started = time.perf_counter()
            if placement.backend == "qnn":
                qnn.lower(spec.index)  # written once all QNN shards share one spill-fill size
            else:
                entries[spec.index] = lower_plain(spec.index)
            seconds[spec.index] = time.perf_counter() - started
        if worker is not None:
            entries.update(worker.join())
            worker = None
    finally:
        if worker is not None:
            worker.stop()
    if not any(p.backend == "qnn" for p in placements):
        return [entries[i] for i in sorted(entries)], None
    # One spill-fill size for every QNN context, cached or not: a cached shard compiled with
    # another size is lowered again (rare: small models need none).
    summary = None
    floor = max((entries[i]["spill_fill_bytes"] for i in qnn_cached), default=0)
    while True:
        if qnn is not None:
            results, summary = qnn.finish({i: names[i] for i in qnn.lowered}, floor)
            floor = summary["spill_fill_bytes"]
            for index, (lowered, own, (sqnr, worst), io_encodings) in results.items():
                entry = write_shard(
                    folder, specs[index], placements[index], lowered, io[index], seconds[index], io_encodings
                )
                entries[index] = {**entry, "spill_fill_bytes": own, "sqnr_db": sqnr, "sqnr_worst_token_db": worst}
                store(cache, keys, entries[index], folder, {SHARED_SPILL_FILL: floor})
        stale = [i for i in qnn_cached if baked_spill_fill[i] != floor]
        if not stale:
            break
        qnn_cached = [i for i in qnn_cached if i not in stale]
        qnn = make_qnn_shards(stale, model, modules, examples, names, placements, config, tokenizer, bos)
        for index in stale:
            started = time.perf_counter()
            qnn.lower(index)
            seconds[index] = time.perf_counter() - started
    return [entries[i] for i in sorted(entries)], summary or cached_qnn_summary(floor)


SHARED_SPILL_FILL = "shared_spill_fill_bytes"  # what a cached QNN shard was compiled with


def lowering_work(spec: ShardSpec, placement: Placement) -> float:
    """A rough share of an export's lowering time: QNN layers take about three times an XNNPACK
    layer (SmolLM2 on this host: ~35 s against ~11 s), an embedding or a head about half a layer."""
    ends = 0.5 * (spec.has_embedding + spec.has_head)
    return (3.0 if placement.backend == "qnn" else 1.0) * len(spec.layers) + ends


def parallel_lowering() -> bool:
    """A second lowering process where there is a second core (COMPOSITE_EXPORT_WORKERS=1: none)."""
    return (os.cpu_count() or 1) >= 2 and os.environ.get("COMPOSITE_EXPORT_WORKERS", "2") != "1"


def shard_file(spec: ShardSpec) -> str:
    return f"shard_{spec.index:02d}.pte"


def make_qnn_shards(indices, model, modules, examples, names, placements, config, tokenizer, bos):
    """The QNN shards to lower (calibrated together), or None when there are none."""
    if not indices:
        return None
    from composite.lowering.qnn import QnnShardLowering, QnnShards

    positions = config.max_seq_len + config.prefill_len
    jobs = {i: QnnShardLowering(modules[i], examples[i], names[i], placements[i].options, positions) for i in indices}
    methods = {DECODE: 1, PREFILL: config.prefill_len}
    return QnnShards(model, modules, jobs, methods, config.max_seq_len, tokenizer, bos)


def cached_qnn_summary(spill_fill_bytes: int) -> dict:
    """The manifest's qnn entry when every QNN shard came from the cache."""
    host = qnn_host.prepare()
    return {
        "build_id": host.build_id,
        "libraries": host.source,
        "spill_fill_bytes": spill_fill_bytes,
        "calibration_seconds": None,
    }


def store(cache: ShardCache | None, keys: dict, entry: dict, folder: Path, extra: dict | None = None) -> None:
    if cache is None:
        entry["cache"] = "off"
        return
    cache.put(keys[entry["index"]], folder / entry["file"], {**entry, **(extra or {})})
    entry["cache"] = "stored"


def cache_keys(model, modules, specs, placements, config, tokenizer, bos) -> dict[int, str]:
    """Each shard's cache key: everything that decides its .pte and manifest entry."""
    common = {
        "versions": versions(),
        "source": shard_cache.source_fingerprint(),
        "model": model.args.to_dict(),
        "max_seq_len": config.max_seq_len,
        "methods": {DECODE: 1, PREFILL: config.prefill_len},
    }
    qnn_common = None
    if any(p.backend == "qnn" for p in placements):
        # A QNN shard's calibration inputs and held-out SQNR input come from the whole float chain.
        qnn_common = {
            "qnn_build": qnn_host.prepare().build_id,
            "float_model": shard_cache.tensors_digest(model),
            "tokenizer": manifest_schema.sha256_file(tokenizer.path) if tokenizer is not None else None,
            "bos": bos,
        }
    keys = {}
    for spec, placement, module in zip(specs, placements, modules):
        parts = {
            **common,
            "weights": shard_cache.tensors_digest(module),
            "layers": [spec.layer_start, spec.layer_end],
            "embedding": spec.has_embedding,
            "head": spec.has_head,
            "placement": {"backend": placement.backend, "options": placement.options},
            "embedding_quantize": config.embedding_bits_and_group() if spec.has_embedding else None,
        }
        if placement.backend == "qnn":
            calibration = placement.options.get("calibration") or {}
            text = hashlib.sha256(calibration_text(calibration).encode()).hexdigest()
            parts["qnn"] = {**qnn_common, "calibration": calibration, "calibration_text": text}
        keys[spec.index] = shard_cache.key_of(parts)
    return keys


def write_shard(
    folder: Path,
    spec: ShardSpec,
    placement: Placement,
    lowered: LoweredShard,
    io: dict,
    seconds: float,
    io_encodings: dict | None = None,
) -> dict:
    """Write one shard's .pte and describe it; the program's own metadata must match the description.
    io_encodings: method -> ("in" | "out", name) -> Encoding of its native I/O tensors."""
    path = folder / shard_file(spec)
    path.write_bytes(lowered.buffer)
    described = {}
    for m, (i, o) in io.items():
        native = {
            key: (manifest_schema.dtype_name(e.dtype), e.quant_entry())
            for key, e in (io_encodings or {}).get(m, {}).items()
        }
        described[m] = {
            "inputs": manifest_schema.tensor_entries(i, {n: q for (side, n), q in native.items() if side == "in"}),
            "outputs": manifest_schema.tensor_entries(o, {n: q for (side, n), q in native.items() if side == "out"}),
        }
    entry = manifest_schema.shard_entry(path, spec, placement, lowered, described, seconds)
    from executorch.runtime import Runtime  # ExecuTorch's whole exir: not loaded before an export gets here

    manifest_schema.check_against_program(Runtime.get().load_program(path), entry)
    return entry


def build_manifest(
    loaded: LoadedModel,
    tokenizer: Tokenizer | None,
    chat: dict | None,
    config: ExportConfig,
    shards: list[dict],
    qnn_summary: dict | None,
) -> dict:
    args = loaded.model.args
    tokenizer_entry = (
        None
        if tokenizer is None
        else {
            "file": tokenizer.path.name,
            "type": tokenizer.kind,
            "sha256": manifest_schema.sha256_file(tokenizer.path),
        }
    )
    return manifest_schema.document(
        export_id=uuid.uuid4().hex,
        model=args.to_dict(),
        source={"kind": loaded.kind, "path": loaded.path, "rotation": config.rotation()},
        max_seq_len=config.max_seq_len,
        prefill_len=config.prefill_len,
        cache_shapes=cache_shapes(args, config.max_seq_len),
        tokenizer=tokenizer_entry,
        bos_id=bos_id(loaded, tokenizer),
        eos_ids=stop_ids(loaded, tokenizer, chat),
        chat=chat,
        shards=shards,
        qnn=qnn_summary,
        versions=versions(),
    )


def stop_ids(loaded: LoadedModel, tokenizer: Tokenizer | None, chat: dict | None) -> list[int]:
    """Every id that ends generation: the checkpoint's, the tokenizer's, the chat template's end of turn."""
    ids = set(loaded.eos_ids) | set(tokenizer.eos_ids if tokenizer else ())
    if chat is not None:
        ids.add(chat["end_of_turn_id"])
    return sorted(ids)


def bos_id(loaded: LoadedModel, tokenizer: Tokenizer | None) -> int | None:
    """A tokenizer.json's post-processor decides BOS, as transformers applies it; otherwise the
    checkpoint's config, then the tokenizer."""
    if tokenizer is not None and tokenizer.kind == "hf_json":
        return tokenizer.bos_id
    if loaded.bos_id is not None:
        return loaded.bos_id
    return tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id >= 0 else None


def versions() -> dict:
    import executorch.version
    import torchao

    return {
        "composite": composite.__version__,
        "torch": torch.__version__,
        "executorch": executorch.version.__version__,
        "torchao": torchao.__version__,
    }


def format_sqnr(db: float | None) -> str:
    return "exact" if db is None or db == float("inf") else f"{db:.1f}"


def print_summary(shards: list[dict], total_seconds: float, output: Path, qnn_summary: dict | None) -> None:
    """One row per shard. cache: "hit" (taken from the shard cache), "stored" (lowered and put
    there) or "off". SQNR (dB, against the float shard on a held-out input) is given for the
    shard's main output per method, decode/prefill, over the whole output and for its worst token;
    the manifest has the first for every output."""
    rows = [("shard", "layers", "backend", "delegates", "size", "seconds", "cache", "SQNR dB", "worst token")]
    for s in shards:
        first, end = s["layers"]
        parts = (
            (["emb"] if s["has_embedding"] else [])
            + ([f"L{first}" if end - first == 1 else f"L{first}-L{end - 1}"] if end > first else [])
            + (["head"] if s["has_head"] else [])
        )
        backend = Placement(s["placement"]["backend"], s["placement"]["options"]).describe()
        sqnr = (
            "/".join(format_sqnr(next(iter(per_output.values()))) for per_output in s["sqnr_db"].values())
            if "sqnr_db" in s
            else "-"
        )
        worst = (
            "/".join(format_sqnr(v) for v in s["sqnr_worst_token_db"].values()) if "sqnr_worst_token_db" in s else "-"
        )
        rows.append(
            (
                str(s["index"]),
                " ".join(parts),
                backend,
                ",".join(s["backends"]) or "none",
                f"{s['size'] / 1e6:.2f} MB",
                f"{s['export_seconds']:.1f}",
                s.get("cache", "-"),
                sqnr,
                worst,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    total = sum(s["size"] for s in shards)
    for s in shards:
        for note in s["notes"]:
            print(f"note: shard {s['index']}: {note}")
    if qnn_summary is not None and qnn_summary.get("calibration_seconds") is not None:
        print(
            f"calibration of the quantized QNN shards (one pass of the float model): "
            f"{qnn_summary['calibration_seconds']:.1f} s, not in the seconds column"
        )
    if qnn_summary is not None:
        print(
            f"QNN {qnn_summary['build_id']} ({qnn_summary['libraries']}); shared spill-fill buffer "
            f"{qnn_summary['spill_fill_bytes']} bytes"
        )
    hits = sum(s.get("cache") == "hit" for s in shards)
    reused = f" ({hits} of them from the cache)" if hits else ""
    print(f"{len(shards)} shards{reused}, {total / 1e6:.2f} MB, {total_seconds:.1f} s -> {output}")


def run_export(config: ExportConfig, cache: ShardCache | None = None) -> Path:
    """Export `config`; shards are taken from and stored in `cache` unless it is None."""
    started = time.perf_counter()
    placements = config.placements()
    if any(p.backend == "qnn" for p in placements):
        qnn_host.activate()  # before any slow work: may re-execute this process once
    output = Path(config.output)
    staging.check_output(output)
    if config.tokenizer:
        Tokenizer(Path(config.tokenizer))  # refuse a bad tokenizer before the weights load
    if config.chat_template:
        chat_template.read_template_file(Path(config.chat_template))
    folder = staging.make_staging(output)
    try:
        loaded = load_checkpoint(config.checkpoint, config.params)
        rotate(loaded.model, config.rotation())
        specs = plan_shards(loaded.model.args, config.shards, config.layers_per_shard)
        check_group_sizes(loaded.model.args, placements)
        if config.embedding_bits_and_group() is not None:
            embedding.check(loaded.model.args.dim, *config.embedding_bits_and_group())
        tokenizer = tokenizer_for_model(config.tokenizer or loaded.tokenizer_path, loaded.model.args.vocab_size)
        first_bos = bos_id(loaded, tokenizer)
        chat = chat_template.chat_entry(
            tokenizer, first_bos, stop_ids(loaded, tokenizer, None), config.chat_template, loaded.chat_template
        )
        shards, qnn_summary = lower_all(loaded, specs, placements, config, tokenizer, folder, first_bos, cache)
        if tokenizer is not None:
            (folder / tokenizer.path.name).write_bytes(tokenizer.path.read_bytes())
        manifest_schema.write(folder, build_manifest(loaded, tokenizer, chat, config, shards, qnn_summary))
        staging.replace_folder(folder, output)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        staging.finished(folder)
        raise
    print_summary(shards, time.perf_counter() - started, output, qnn_summary)
    return output


def terminated(signum, _frame):
    """Clean up here and leave at once. An exception raised from a signal handler can land where
    Python ignores it (a fork hook, a finalizer: seen in CI), and the export would carry on."""
    ForkedWorker.kill_all()
    staging.remove_unfinished()
    os._exit(128 + signum)


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)
    config = config_from_flags(args)
    if any(p.backend == "qnn" for p in config.placements()):
        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    try:
        with quiet.filtered_native_stderr(args.verbose):
            run_export(config, None if args.no_cache else ShardCache.from_environment())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(
                f"out of disk space while writing the export ({e.filename or 'artifacts'}); nothing was replaced"
            ) from None
        raise


if __name__ == "__main__":
    main()
