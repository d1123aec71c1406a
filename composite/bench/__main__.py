"""python -m composite.bench: our shard pipeline beside ExecuTorch's own single-.pte llama and, with
--llama-cpp, llama.cpp at the same precision.

Same random-weight checkpoint, same prompt tokens, same machine. Exports are cached under --work
(keyed by everything that shapes them), runs are interleaved (peer, ours, peer, ours, ...) and
the table shows medians over --repeats. Writes bench.json, one stats JSON per configuration (the
median-decode run) and bench.png, the time per token in each shard and in KV writes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from composite.bench import llama_cpp, peer
from composite.bench.workload import DIMS, Dims, prompt_ids, write_workload
from composite.errors import UserError, exits_cleanly
from composite.manifest_files import stored_bytes
from composite.report import read_stats, render
from composite.shard_cache import source_fingerprint
from composite.units import MB

QUANTS = ("fp32", "fp16", "8da8w", "8da4w")
# ours: the export flags of each precision
EXPORT_FLAGS = {
    "fp32": ["--quantize", "none"],
    "fp16": ["--dtype", "fp16"],
    "8da8w": ["--quantize", "8da8w"],
    "8da4w": ["--quantize", "8da4w", "--head-quantize", "same"],  # a 4-bit head, as export_llama's 8da4w has
}
# ExecuTorch's export_llama has no 8da8w that runs on XNNPACK (its torchao:8da8w packs for torchao's
# own kernels), so that precision has no ExecuTorch peer.
PEER_QUANTS = ("fp32", "fp16", "8da4w")


@dataclass
class Config:
    name: str  # "peer fp32", "ours 6 fp32", "llama.cpp fp32"
    kind: str  # "peer" | "ours" | "llama.cpp"
    quant: str
    shards: int
    artifact: Path  # peer: the .pte; ours: the artifacts folder; llama.cpp: the .gguf
    export_seconds: float
    size_bytes: int


def _csv(text: str, cast, allowed=None, flag="") -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UserError(f"{flag} needs at least one value")
    try:
        values = [cast(x) for x in items]
    except ValueError:
        raise UserError(f"{flag} must be a comma-separated list, got '{text}'") from None
    if allowed is not None:
        bad = [v for v in values if v not in allowed]
        if bad:
            raise UserError(f"{flag}: unknown value '{bad[0]}' (choose from {', '.join(map(str, allowed))})")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.bench", description=__doc__.split(":", 1)[1].strip())
    p.add_argument("--dims", default="stories110m", choices=sorted(DIMS), help="model dimensions (default stories110m)")
    p.add_argument("--shards", default="1,6", help="shard counts of our pipeline (default 1,6)")
    p.add_argument("--quant", default="fp32", help=f"{', '.join(QUANTS)}, comma separated (default fp32)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per configuration (default 5)")
    p.add_argument("--prefill-len", type=int, default=64, help="tokens per prefill call of our shards (default 64)")
    p.add_argument("--attention", default="kernel", help="our XNNPACK attention: kernel and/or graph (default kernel)")
    p.add_argument("--no-peer", action="store_true", help="skip ExecuTorch's llama")
    p.add_argument(
        "--llama-cpp",
        nargs="?",
        const=str(llama_cpp.DEFAULT_FOLDER),
        metavar="DIR",
        help="add llama.cpp's llama-bench at each precision (GGUF F32/F16/Q8_0/Q4_0), built by "
        f"scripts/build_llama_cpp.sh (default DIR {llama_cpp.DEFAULT_FOLDER})",
    )
    p.add_argument("--runner", default="build/composite_runner", help="composite_runner binary")
    p.add_argument("--work", default=None, help="export cache (default ~/.cache/composite/bench)")
    p.add_argument("--output", default="bench", help="where bench.json, stats and bench.png go (default ./bench)")
    return p.parse_args(argv)


def _executorch_version() -> str:
    from importlib.metadata import version

    return version("executorch")


def _cached(folder: Path, key: dict, build) -> float:
    """Run build() into `folder` unless a finished build with the same key is there; returns its
    export seconds (measured when it was built)."""
    stamp = folder / "bench_stamp.json"
    if stamp.exists():
        saved = json.loads(stamp.read_text())
        if saved.get("key") == key:
            return saved["export_seconds"]
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    build()
    seconds = time.perf_counter() - start
    stamp.write_text(json.dumps({"key": key, "export_seconds": seconds}))
    return seconds


def export_peer(paths: dict, dims: Dims, quant: str, work: Path) -> Config:
    folder = work / f"peer_{quant}"
    pte = folder / "llama.pte"
    key = {"dims": dims.__dict__, "quant": quant, "executorch": _executorch_version()}
    print(f"peer {quant}: ExecuTorch llama export (cached in {folder})", flush=True)
    seconds = _cached(folder, key, lambda: peer.export(paths, dims.max_seq_len, quant, pte, folder / "export.log"))
    return Config(f"peer {quant}", "peer", quant, 1, pte, seconds, pte.stat().st_size)


def export_ours(
    paths: dict, dims: Dims, quant: str, shards: int, prefill_len: int, attention: str, work: Path
) -> Config:
    folder = work / f"ours_{shards}_{quant}_p{prefill_len}_{attention}"
    artifacts = folder / "artifacts"
    key = {
        "dims": dims.__dict__,
        "quant": quant,
        "shards": shards,
        "prefill_len": prefill_len,
        "attention": attention,
        "composite": source_fingerprint()[:12],
        "executorch": _executorch_version(),
    }
    command = [
        sys.executable,
        "-m",
        "composite.export",
        "--checkpoint",
        str(paths["consolidated.00.pth"]),
        "--params",
        str(paths["params.json"]),
        "--tokenizer",
        str(paths["tokenizer.model"]),
        "--shards",
        str(shards),
        "--placement",
        "xnnpack",
        "--max-seq-len",
        str(dims.max_seq_len),
        "--prefill-len",
        str(prefill_len),
        *EXPORT_FLAGS[quant],
        "--attention",
        attention,
        "--output",
        str(artifacts),
        "--no-cache",  # the export's seconds are a cold export's
    ]

    def build():
        log = folder / "export.log"
        with open(log, "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise UserError(f"our export of {shards} shards {quant} failed (exit {done.returncode}); see {log}")

    print(f"ours {shards} shard(s) {quant}: composite export (cached in {folder})", flush=True)
    seconds = _cached(folder, key, build)
    manifest = json.loads((artifacts / "manifest.json").read_text())
    size = stored_bytes(manifest["shards"])
    name = f"ours {shards} {quant}" + (" graph" if attention == "graph" else "")
    return Config(name, "ours", quant, shards, artifacts, seconds, size)


def export_llama_cpp(paths: dict, dims: Dims, quant: str, llama_cpp_folder: Path, work: Path) -> Config:
    """GGUF files live together in work/gguf (Q8_0 and Q4_0 are quantized from F32); each
    precision's stamp, with the seconds its conversion took, in work/llama_cpp_<quant>."""
    gguf = work / "gguf" / f"model-{llama_cpp.GGUF_TYPES[quant]}.gguf"
    key = {"dims": dims.__dict__, "quant": quant, "llama.cpp": str(llama_cpp_folder)}
    print(f"llama.cpp {quant}: GGUF {llama_cpp.GGUF_TYPES[quant]} (cached in {work / 'gguf'})", flush=True)

    def build():
        gguf.unlink(missing_ok=True)
        hf = llama_cpp.write_hf_folder(paths, work / "gguf" / "hf")
        llama_cpp.write_gguf(llama_cpp_folder, hf, quant, work / "gguf")

    if not gguf.exists():  # a stamp without its file is stale
        (work / f"llama_cpp_{quant}" / "bench_stamp.json").unlink(missing_ok=True)
    seconds = _cached(work / f"llama_cpp_{quant}", key, build)
    return Config(f"llama.cpp {quant}", "llama.cpp", quant, 1, gguf, seconds, gguf.stat().st_size)


def run_once(
    config: Config,
    paths: dict,
    dims: Dims,
    runner: Path,
    out_dir: Path,
    repeat: int,
    llama_cpp_folder: Path | None = None,
) -> dict:
    if config.kind == "llama.cpp":
        return llama_cpp.bench_once(
            llama_cpp_folder, config.artifact, config.quant, dims.prompt_tokens, dims.new_tokens, os.cpu_count() or 1
        )
    if config.kind == "peer":
        command = [
            sys.executable,
            "-m",
            "composite.bench.peer",
            "run",
            str(config.artifact),
            str(paths["tokenizer.model"]),
            str(paths["prompt.txt"]),
            str(dims.new_tokens),
            str(dims.max_seq_len),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith('{"runner"')]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"{config.name} run failed (exit {done.returncode}): {tail}")
        return json.loads(lines[-1])
    stats_path = out_dir / "runs" / f"{config.name.replace(' ', '_')}_{repeat}.json"
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    ids = ",".join(map(str, prompt_ids(paths)))
    command = [
        str(runner),
        "--artifacts",
        str(config.artifact),
        "--prompt_ids",
        ids,
        "--max_new_tokens",
        str(dims.new_tokens),
        "--stats_json",
        str(stats_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{config.name} run failed (exit {done.returncode}): {tail}")
    stats = json.loads(stats_path.read_text())
    stats["stats_file"] = str(stats_path)
    return stats


METRICS = ("prefill_tokens_per_s", "decode_tokens_per_s", "time_to_first_token_ms", "peak_rss_mb")


def summarize(configs: list[Config], runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for c in configs:
        rs = runs[c.name]
        row = {m: statistics.median(r[m] for r in rs) for m in METRICS}
        if c.kind == "peer":
            # ExecuTorch's runner runs inside Python; what the interpreter and torch held before the runner
            # existed is not the runner's memory.
            row["runner_rss_mb"] = statistics.median(r["peak_rss_mb"] - r["interpreter_rss_mb"] for r in rs)
        else:
            row["runner_rss_mb"] = row["peak_rss_mb"]
        row.update(
            export_seconds=c.export_seconds,
            size_mb=c.size_bytes / MB,
            prompt_tokens=rs[0]["prompt_tokens"],
            runs=len(rs),
        )
        summary[c.name] = row
    return summary


def ratio_lines(configs: list[Config], summary: dict) -> list[str]:
    lines = []
    for c in configs:
        if c.kind != "ours":
            continue
        mine = summary[c.name]
        for other in (f"peer {c.quant}", f"llama.cpp {c.quant}"):
            row = summary.get(other)
            if row:
                lines.append(
                    f"{c.name} / {other}: decode {mine['decode_tokens_per_s'] / row['decode_tokens_per_s']:.2f}x, "
                    f"prefill {mine['prefill_tokens_per_s'] / row['prefill_tokens_per_s']:.2f}x, "
                    f"runner RSS {mine['runner_rss_mb'] / row['runner_rss_mb']:.2f}x, "
                    f"size {mine['size_mb'] / row['size_mb']:.3f}x"
                )
        one = summary.get(f"ours 1 {c.quant}")
        if one and c.shards != 1:
            lines.append(
                f"{c.name} / ours 1 {c.quant}: decode {mine['decode_tokens_per_s'] / one['decode_tokens_per_s']:.3f}x, "
                f"prefill {mine['prefill_tokens_per_s'] / one['prefill_tokens_per_s']:.3f}x, "
                f"size {mine['size_mb'] / one['size_mb']:.4f}x"
            )
    return lines


def table(summary: dict) -> str:
    rows = [
        "| configuration | prefill tok/s | decode tok/s | first token ms | peak RSS MB | runner RSS MB | .pte MB | export s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in summary.items():
        rows.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | {r['time_to_first_token_ms']:.0f} "
            f"| {r['peak_rss_mb']:.0f} | {r['runner_rss_mb']:.0f} | {r['size_mb']:.1f} | {r['export_seconds']:.0f} |"
        )
    return "\n".join(rows)


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores {model or platform.machine()}, {platform.system()}"


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    dims = DIMS[args.dims]
    shard_counts = _csv(args.shards, int, flag="--shards")
    quants = _csv(args.quant, str, QUANTS, flag="--quant")
    attentions = _csv(args.attention, str, ("graph", "kernel"), flag="--attention")
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    runner = Path(args.runner)
    if not runner.is_file() or not os.access(runner, os.X_OK):
        raise UserError(
            f"composite_runner not found at {runner}: build it (bash scripts/build_runner.sh build) or pass --runner"
        )
    llama_cpp_folder = Path(args.llama_cpp) if args.llama_cpp else None
    if llama_cpp_folder is not None:
        llama_cpp.binaries(llama_cpp_folder)  # built, or one line saying how
    work = Path(args.work or Path.home() / ".cache" / "composite" / "bench") / args.dims
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)

    paths = write_workload(dims, work / "workload")
    configs: list[Config] = []
    for quant in quants:
        if not args.no_peer and quant in PEER_QUANTS:
            configs.append(export_peer(paths, dims, quant, work))
        elif not args.no_peer:
            print(f"peer {quant}: none (ExecuTorch's export_llama has no XNNPACK {quant})", flush=True)
        if llama_cpp_folder is not None:
            configs.append(export_llama_cpp(paths, dims, quant, llama_cpp_folder, work))
        for shards in shard_counts:
            for attention in attentions:
                configs.append(export_ours(paths, dims, quant, shards, args.prefill_len, attention, work))

    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for repeat in range(args.repeats):
        for c in configs:  # interleaved: drifts of the machine hit every configuration alike
            stats = run_once(c, paths, dims, runner, out_dir, repeat, llama_cpp_folder)
            runs[c.name].append(stats)
            print(
                f"  run {repeat + 1}/{args.repeats} {c.name}: prefill {stats['prefill_tokens_per_s']:.0f} tok/s, "
                f"decode {stats['decode_tokens_per_s']:.1f} tok/s",
                flush=True,
            )

    summary = summarize(configs, runs)
    ratios = ratio_lines(configs, summary)
    header = (
        f"composite.bench --dims {args.dims} ({dims.dim} dim, {dims.n_layers} layers, vocab {dims.vocab_size}, "
        f"context {dims.max_seq_len}, prompt {dims.prompt_tokens} tokens, {dims.new_tokens} new), "
        f"medians of {args.repeats} interleaved runs, {date.today().isoformat()}, {machine()}"
    )
    print("\n" + header + "\n\n" + table(summary) + "\n\n" + "\n".join(ratios))

    picked, labels = [], []
    for c in configs:
        if c.kind == "ours":
            median_run = sorted(runs[c.name], key=lambda r: r["decode_tokens_per_s"])[len(runs[c.name]) // 2]
            picked.append(read_stats(Path(median_run["stats_file"]), c.name))
            labels.append(c.name)
    if picked:
        render(picked, out_dir / "bench.png", f"composite.bench {args.dims}: time per token by shard")
    (out_dir / "bench.json").write_text(
        json.dumps({"header": header, "summary": summary, "ratios": ratios, "runs": runs}, indent=1) + "\n"
    )
    print(f"\nwrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")


if __name__ == "__main__":
    main()
