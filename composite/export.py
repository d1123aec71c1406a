"""python -m composite.export: cut a LLaMA into N shards and lower each to its own .pte.

Artifacts are written into a staging folder beside the target and renamed into place only when
complete, so a failed export never leaves a folder that looks usable.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from composite import quiet

quiet.silence_library_noise()

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from composite import manifest as manifest_schema  # noqa: E402
from composite.config import ExportConfig, Placement, build_config  # noqa: E402
from composite.errors import UserError, exits_cleanly  # noqa: E402
from composite.manifest import DECODE, PREFILL  # noqa: E402
from composite.model.checkpoint import load_checkpoint  # noqa: E402
from composite.model.llama import cache_shapes  # noqa: E402
from composite.model.loaded import LoadedModel  # noqa: E402
from composite.split.plan import ShardSpec, plan_shards  # noqa: E402
from composite.split.shard import ShardModule, shard_io  # noqa: E402
from composite.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.export", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (flags below override it)")
    p.add_argument("--shards", type=int, help="number of shards (default 1)")
    p.add_argument("--placement", help="backend per shard, comma separated (xnnpack,portable,qnn), or one for all")
    p.add_argument("--layers-per-shard", help="explicit decoder layers per shard, comma separated, e.g. 0,3,3,0")
    p.add_argument("--checkpoint", help="Meta .pth/.pt (+ params.json) or Hugging Face folder; none = embedded default")
    p.add_argument("--params", help="params.json for a Meta checkpoint")
    p.add_argument("--tokenizer", help="tokenizer.model (SentencePiece or tiktoken) or tokenizer.json")
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default 512)")
    p.add_argument("--prefill-len", type=int, help="tokens per prefill call (default 64)")
    p.add_argument("--quantize", choices=["none", "8da4w"], help="XNNPACK weight quantization")
    p.add_argument("--group-size", type=int, help="8da4w group size (default 32)")
    p.add_argument("--output", help="artifacts folder (default ./artifacts)")
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got '{text}'") from None


def config_from_args(args) -> ExportConfig:
    placement = None
    if args.placement is not None:
        names = [x.strip() for x in args.placement.split(",")]
        placement = names[0] if len(names) == 1 else names
    overrides = {
        "shards": args.shards,
        "placement": placement,
        "layers_per_shard": _int_list(args.layers_per_shard, "--layers-per-shard"),
        "checkpoint": args.checkpoint,
        "params": args.params,
        "tokenizer": args.tokenizer,
        "max_seq_len": args.max_seq_len,
        "prefill_len": args.prefill_len,
        "output": args.output,
    }
    config = build_config(args.config, overrides)
    if args.quantize is not None:
        config.xnnpack["quantize"] = args.quantize
    if args.group_size is not None:
        config.xnnpack["group_size"] = args.group_size
    config.placements()
    return config


def resolve_tokenizer(config: ExportConfig, loaded: LoadedModel) -> Tokenizer | None:
    path = config.tokenizer or loaded.tokenizer_path
    if path is None:
        print("note: no tokenizer found beside the checkpoint; runners will need --prompt-ids", file=sys.stderr)
        return None
    tokenizer = Tokenizer(Path(path))
    vocab = loaded.model.args.vocab_size
    if tokenizer.vocab_size > vocab:
        raise UserError(
            f"tokenizer {path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {vocab}: "
            "wrong tokenizer for this checkpoint?"
        )
    if tokenizer.vocab_size < vocab:
        print(
            f"note: tokenizer has {tokenizer.vocab_size} tokens, the model {vocab} (padded vocabulary)", file=sys.stderr
        )
    return tokenizer


def check_group_sizes(args, placements: list[Placement]) -> None:
    """8da4w groups must divide a linear's input width, or that linear stays fp32: say so before
    any lowering, and refuse a group size that would leave every linear unquantized."""
    widths = {"dim": args.dim, "hidden_dim": args.hidden_dim, "n_heads x head_dim": args.n_heads * args.head_dim}
    for group in sorted(
        {
            p.options["group_size"]
            for p in placements
            if p.backend == "xnnpack" and p.options["quantize"] == "8da4w" and p.options["group_size"]
        }
    ):
        misfits = {name: width for name, width in widths.items() if width % group}
        described = ", ".join(f"{name} {width}" for name, width in misfits.items())
        if len(misfits) == len(widths):
            raise UserError(
                f"--group-size {group} divides none of this model's linear input widths ({described}): "
                "nothing would be quantized; choose a divisor of them (e.g. 32), or 0 for per channel"
            )
        if misfits:
            print(f"warning: group size {group} does not divide {described}: those linears stay fp32", file=sys.stderr)


def method_inputs(args, spec: ShardSpec, config: ExportConfig) -> dict[str, tuple]:
    return {
        name: tuple(t.example() for t in shard_io(args, spec, n, config.max_seq_len)[0])
        for name, n in (("decode", 1), ("prefill", config.prefill_len))
    }


def shard_entry(
    model, spec: ShardSpec, placement: Placement, config: ExportConfig, staging: Path, lowered, seconds: float
) -> dict:
    """Write one lowered shard and describe it for the manifest."""
    file_name = f"shard_{spec.index:02d}.pte"
    path = staging / file_name
    path.write_bytes(lowered.buffer)
    methods = {DECODE: 1, PREFILL: config.prefill_len}
    io = {}
    for method, n_tokens in methods.items():
        inputs, outputs = shard_io(model.args, spec, n_tokens, config.max_seq_len)
        io[method] = {
            "inputs": manifest_schema.tensor_entries(inputs),
            "outputs": manifest_schema.tensor_entries(outputs),
        }
    return {
        "index": spec.index,
        "file": file_name,
        "sha256": manifest_schema.sha256_file(path),
        "size": path.stat().st_size,
        "layers": [spec.layer_start, spec.layer_end],
        "has_embedding": spec.has_embedding,
        "has_head": spec.has_head,
        "placement": {"backend": placement.backend, "options": placement.options},
        "backends": lowered.backends,
        "delegates": lowered.delegates,
        "cpu_ops": lowered.cpu_ops,
        "io": io,
        "export_seconds": round(seconds, 2),
        "notes": lowered.notes,
    }


def calibrate_qnn_shards(
    loaded: LoadedModel, modules: list[ShardModule], jobs: dict, config: ExportConfig, tokenizer: Tokenizer | None
) -> dict[int, dict[str, tuple]]:
    """Feed every QNN shard's observers its real inputs (quantized precisions); return one held-out
    input per QNN shard and method for measuring SQNR. Shards sharing calibration options share
    one pass of the float chain."""
    from composite.lowering.calibration import calibrate

    groups: dict[str, dict] = {}
    for index, job in jobs.items():
        key = json.dumps(job.options.get("calibration") or {}, sort_keys=True)
        groups.setdefault(key, {})[index] = job
    methods = {DECODE: 1, PREFILL: config.prefill_len}
    held_out = {}
    for key, group in groups.items():
        consumers = {
            index: (job.observe if job.quantized else (lambda method, inputs: None)) for index, job in group.items()
        }
        options = json.loads(key)
        if not any(job.quantized for job in group.values()):
            options["samples"] = 0  # fp16 shards need only the held-out input, to measure SQNR
        held_out.update(calibrate(loaded.model, modules, consumers, methods, config.max_seq_len, options, tokenizer))
    return held_out


def measure_sqnr(path: Path, module: ShardModule, held_out: dict[str, tuple], output_names: dict) -> dict:
    """method -> output name -> SQNR (dB) of the lowered shard against the float shard."""
    from executorch.runtime import Runtime

    from composite.lowering.calibration import sqnr_db

    program = Runtime.get().load_program(path)
    result = {}
    for method in output_names:
        inputs = held_out[method]
        actual = program.load_method(method).execute(list(inputs))
        with torch.no_grad():
            expected = module(*inputs)
        result[method] = {name: round(sqnr_db(e, a), 2) for name, e, a in zip(output_names[method], expected, actual)}
    return result


def lower_all(
    loaded: LoadedModel,
    specs: list[ShardSpec],
    placements: list[Placement],
    config: ExportConfig,
    tokenizer: Tokenizer | None,
    staging: Path,
) -> tuple[list[dict], dict | None]:
    from composite.lowering import finish, lower_shard

    model = loaded.model
    modules = [ShardModule(model, spec).eval() for spec in specs]
    qnn_jobs, held_out = {}, {}
    calibration_seconds = None
    if any(p.backend == "qnn" for p in placements):
        from composite.lowering.qnn import QnnShardLowering

        for spec, placement, module in zip(specs, placements, modules):
            if placement.backend == "qnn":
                qnn_jobs[spec.index] = QnnShardLowering(
                    module,
                    method_inputs(model.args, spec, config),
                    placement.options,
                    n_positions=config.max_seq_len + config.prefill_len,
                )
        started = time.perf_counter()
        held_out = calibrate_qnn_shards(loaded, modules, qnn_jobs, config, tokenizer)
        if any(job.quantized for job in qnn_jobs.values()):
            calibration_seconds = time.perf_counter() - started
    entries: dict[int, dict] = {}
    pending_qnn = []  # QNN shards wait for the spill-fill size shared by all of them
    for spec, placement, module in tqdm(
        list(zip(specs, placements, modules)), desc="lowering shards", unit="shard", file=sys.stderr
    ):
        started = time.perf_counter()
        if placement.backend == "qnn":
            edge, notes = qnn_jobs.pop(spec.index).lower()  # drop the prepared graphs once lowered
            pending_qnn.append((spec, placement, edge, notes, time.perf_counter() - started))
            continue
        edge, notes = lower_shard(module, method_inputs(model.args, spec, config), placement)
        lowered = finish(edge, notes)
        entries[spec.index] = shard_entry(
            model, spec, placement, config, staging, lowered, time.perf_counter() - started
        )
    qnn_summary = None
    if pending_qnn:
        from composite import qnn_host
        from composite.lowering import qnn

        spill_fill, own_spill_fill = qnn.share_spill_fill([edge for _, _, edge, _, _ in pending_qnn])
        host = qnn_host.prepare()
        qnn_summary = {
            "build_id": host.build_id,
            "libraries": host.source,
            "spill_fill_bytes": spill_fill,
            "calibration_seconds": None if calibration_seconds is None else round(calibration_seconds, 2),
        }
        for (spec, placement, edge, notes, seconds), own in zip(pending_qnn, own_spill_fill):
            started = time.perf_counter()
            entry = shard_entry(
                model, spec, placement, config, staging, finish(edge, notes), seconds + time.perf_counter() - started
            )
            names = {m: [o["name"] for o in entry["io"][m]["outputs"]] for m in entry["io"]}
            entry["spill_fill_bytes"] = own
            entry["sqnr_db"] = measure_sqnr(staging / entry["file"], modules[spec.index], held_out[spec.index], names)
            entries[spec.index] = entry
    return [entries[i] for i in sorted(entries)], qnn_summary


def check_against_runtime(staging: Path, shard: dict) -> None:
    """The lowered program's own method metadata must match what the manifest promises."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(staging / shard["file"])
    # ExecuTorch ScalarType codes
    names = {6: "float32", 4: "int64", 5: "float16", 3: "int32", 0: "uint8", 27: "uint16"}
    for method, io in shard["io"].items():
        meta = program.metadata(method)
        for kind, count, get in (
            ("inputs", meta.num_inputs(), meta.input_tensor_meta),
            ("outputs", meta.num_outputs(), meta.output_tensor_meta),
        ):
            expected = io[kind]
            if count != len(expected):
                raise RuntimeError(f"shard {shard['index']} {method}: {count} {kind}, manifest says {len(expected)}")
            for i, entry in enumerate(expected):
                info = get(i)
                dtype = names.get(int(info.dtype()), str(info.dtype()))
                if list(info.sizes()) != entry["shape"] or dtype != entry["dtype"]:
                    raise RuntimeError(
                        f"shard {shard['index']} {method} {kind[:-1]} {entry['name']}: program has "
                        f"{list(info.sizes())} {dtype}, manifest says {entry['shape']} {entry['dtype']}"
                    )


def versions() -> dict:
    import executorch.version
    import torchao

    import composite

    return {
        "composite": composite.__version__,
        "torch": torch.__version__,
        "executorch": executorch.version.__version__,
        "torchao": torchao.__version__,
    }


def build_manifest(
    loaded: LoadedModel, tokenizer: Tokenizer | None, config: ExportConfig, shards: list[dict], qnn_summary: dict | None
) -> dict:
    args = loaded.model.args
    k_shape, v_shape = cache_shapes(args, config.max_seq_len)
    bos = loaded.bos_id if loaded.bos_id is not None else (tokenizer.bos_id if tokenizer else None)
    eos = list(loaded.eos_ids) or (list(tokenizer.eos_ids) if tokenizer else [])
    tokenizer_entry = None
    if tokenizer is not None:
        tokenizer_entry = {
            "file": tokenizer.path.name,
            "type": tokenizer.kind,
            "sha256": manifest_schema.sha256_file(tokenizer.path),
        }
    return {
        "format": manifest_schema.FORMAT,
        "version": manifest_schema.VERSION,
        "export_id": uuid.uuid4().hex,
        "model": args.to_dict(),
        "source": {"kind": loaded.kind, "path": loaded.path},
        "max_seq_len": config.max_seq_len,
        "methods": {DECODE: 1, PREFILL: config.prefill_len},
        "kv_cache": {
            "dtype": "float32",
            "k_shape": k_shape,
            "v_shape": v_shape,
            "k_new_shape": "[n_kv_heads, head_dim, T]",
            "v_new_shape": "[n_kv_heads, T, head_dim]",
        },
        "mask": {"shape": "[T, max_seq_len + T]", "visible": 0.0, "hidden": manifest_schema.MASK_HIDDEN},
        "tokenizer": tokenizer_entry,
        "bos_id": bos,
        "eos_ids": eos,
        "shards": shards,
        "qnn": qnn_summary,
        "versions": versions(),
    }


def format_sqnr(db: float | None) -> str:
    return "exact" if db is None or db == float("inf") else f"{db:.1f}"


def print_summary(shards: list[dict], total_seconds: float, output: Path, qnn_summary: dict | None) -> None:
    """One row per shard. SQNR (dB, against the float shard on a held-out input) is given for the
    shard's main output per method, decode/prefill; the manifest has it for every output."""
    rows = [("shard", "layers", "backend", "delegates", "size", "seconds", "SQNR dB")]
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
        rows.append(
            (
                str(s["index"]),
                " ".join(parts),
                backend,
                ",".join(s["backends"]) or "none",
                f"{s['size'] / 1e6:.2f} MB",
                f"{s['export_seconds']:.1f}",
                sqnr,
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
    print(f"{len(shards)} shards, {total / 1e6:.2f} MB, {total_seconds:.1f} s -> {output}")


def run_export(config: ExportConfig) -> Path:
    started = time.perf_counter()
    placements = config.placements()
    if any(p.backend == "qnn" for p in placements):
        from composite import qnn_host

        qnn_host.activate()  # before any slow work: may re-execute this process once
    output = Path(config.output)
    check_output(output)
    staging = make_staging(output)
    try:
        loaded = load_checkpoint(config.checkpoint, config.params)
        args = loaded.model.args
        specs = plan_shards(args, config.shards, config.layers_per_shard)
        check_group_sizes(args, placements)
        tokenizer = resolve_tokenizer(config, loaded)
        shards, qnn_summary = lower_all(loaded, specs, placements, config, tokenizer, staging)
        for shard in shards:
            check_against_runtime(staging, shard)
        if tokenizer is not None:
            shutil.copyfile(tokenizer.path, staging / tokenizer.path.name)
        manifest_schema.write(staging, build_manifest(loaded, tokenizer, config, shards, qnn_summary))
        replace_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print_summary(shards, time.perf_counter() - started, output, qnn_summary)
    return output


def check_output(output: Path) -> None:
    """Refuse a target that cannot take an export before any slow work; say when one is replaced."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not (output / manifest_schema.FILENAME).exists():
            raise UserError(
                f"--output {output} is a non-empty folder that is not a composite export; refusing to replace it"
            )
        print(f"note: {output} holds an earlier export; it is replaced when this one is complete", file=sys.stderr)


def make_staging(output: Path) -> Path:
    """The hidden folder the export is written into, beside the target and named after this
    process; ones left by exports that died (their process is gone) are removed first."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        for leftover in output.parent.glob(f".{output.name}.partial-*"):
            if not process_alive(leftover.name.rsplit(".partial-", 1)[1].split("-", 1)[0]):
                shutil.rmtree(leftover, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-{os.getpid()}-", dir=output.parent))
    except OSError as e:
        raise UserError(f"cannot write an export to {output}: {e.strerror}") from None


def process_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


def replace_folder(staging: Path, output: Path) -> None:
    """Move the complete staging folder to `output`; an older export there is swapped out whole."""
    os.chmod(staging, 0o755)
    if not output.exists():
        os.rename(staging, output)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.rename(output, retired / "artifacts")
    os.rename(staging, output)
    shutil.rmtree(retired, ignore_errors=True)


def terminated(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through run_export, which removes its staging folder


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)
    config = config_from_args(args)
    if any(p.backend == "qnn" for p in config.placements()):
        from composite import qnn_host

        qnn_host.activate()  # re-executes this process once, before its stderr is filtered
    try:
        with quiet.filtered_native_stderr(args.verbose):
            run_export(config)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(
                f"out of disk space while writing the export ({e.filename or 'artifacts'}); nothing was replaced"
            ) from None
        raise


if __name__ == "__main__":
    main()
