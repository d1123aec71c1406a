"""python -m composite.report: where the time goes, from the runners' stats files.

One or more stats files (several compare placements side by side) become a PNG of time per token
spent in each shard, coloured by backend, and in KV-cache writes, for decode and for prefill, and
a markdown table of the same numbers on stdout.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from composite.errors import UserError, exits_cleanly
from composite.units import MB

BACKEND_COLOURS = {"XnnpackBackend": "#4C78A8", "QnnBackend": "#F58518", "portable": "#9D9D9D"}
BACKEND_NAMES = {"XnnpackBackend": "XNNPACK", "QnnBackend": "QNN HTP", "portable": "portable"}
KV_COLOUR = "#54A24B"
SIMULATED_HATCH = "///"
RUNNERS = ("composite_runner", "composite.run")  # both write the same stats schema


@dataclass
class RunTimes:
    """Per-token milliseconds of one run, as plotted."""

    label: str
    shard_labels: list[str]  # e.g. "0 emb", "1 L0-L2"
    backends: list[str]
    decode_ms: list[float]  # per shard
    prefill_ms: list[float]  # per shard
    decode_kv_ms: float
    prefill_kv_ms: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    qnn_simulated: bool = False  # QNN shards ran on the x86 HTP simulator: not a phone's timing
    # Bytes per shard: the KV cache it owns, and what it takes in / gives out per decode step
    # (absent from stats written before these were recorded).
    kv_bytes: list[int] | None = None
    io_bytes: list[tuple[int, int]] | None = None


def _number_list(stats: dict, key: str, count: int, source: str) -> list[float]:
    values = stats.get(key)
    if not isinstance(values, list) or len(values) != count or not all(isinstance(v, (int, float)) for v in values):
        raise UserError(f"{source}: '{key}' must be a list of {count} numbers, one per shard")
    return [float(v) for v in values]


def read_stats(path: Path, label: str | None = None) -> RunTimes:
    try:
        stats = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"stats file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read stats file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"stats file {path} is not valid JSON: {e}") from None
    if not isinstance(stats, dict) or stats.get("runner") not in RUNNERS:
        raise UserError(f"{path} is not a stats file of composite_runner --stats_json or composite.run --stats-json")
    backends = stats.get("shard_backends")
    if not isinstance(backends, list) or not backends:
        raise UserError(f"{path}: 'shard_backends' is missing; write it with this version of composite_runner")
    n = len(backends)
    layers = stats.get("shard_layers") or [""] * n
    for key in (
        "kv_write_ms_per_token",
        "prefill_kv_write_ms_per_token",
        "decode_tokens_per_s",
        "prefill_tokens_per_s",
    ):
        if not isinstance(stats.get(key), (int, float)):
            raise UserError(f"{path}: '{key}' must be a number")
    return RunTimes(
        label=label or Path(path).stem,
        shard_labels=[f"{i} {layer}".strip() for i, layer in enumerate(layers)],
        backends=[str(b) for b in backends],
        decode_ms=_number_list(stats, "shard_ms_per_token", n, str(path)),
        prefill_ms=_number_list(stats, "prefill_shard_ms_per_token", n, str(path)),
        decode_kv_ms=float(stats["kv_write_ms_per_token"]),
        prefill_kv_ms=float(stats["prefill_kv_write_ms_per_token"]),
        decode_tokens_per_s=float(stats["decode_tokens_per_s"]),
        prefill_tokens_per_s=float(stats["prefill_tokens_per_s"]),
        qnn_simulated=bool(stats.get("qnn_simulator", False)),
        kv_bytes=_number_list(stats, "kv_cache_bytes_per_shard", n, str(path)) if "kv_cache_bytes" in stats else None,
        io_bytes=_io_bytes(stats, n, str(path)) if "decode_io_bytes_per_shard" in stats else None,
    )


def _io_bytes(stats: dict, count: int, source: str) -> list[tuple[int, int]]:
    values = stats["decode_io_bytes_per_shard"]
    if not isinstance(values, list) or len(values) != count or not all(isinstance(v, dict) for v in values):
        raise UserError(f"{source}: 'decode_io_bytes_per_shard' must list {count} {{in, out}} entries, one per shard")
    return [(int(v.get("in", 0)), int(v.get("out", 0))) for v in values]


def markdown_table(runs: list[RunTimes]) -> str:
    rows = [
        "| run | shard | backend | decode ms/token | prefill ms/token | KV cache MB | decode step in / out KB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        n = len(run.backends)
        kv = [f"{b / MB:.2f}" for b in run.kv_bytes] if run.kv_bytes else [""] * n
        io = [f"{i / 1e3:.1f} / {o / 1e3:.1f}" for i, o in run.io_bytes] if run.io_bytes else [""] * n
        for name, backend, d, p, k, x in zip(run.shard_labels, run.backends, run.decode_ms, run.prefill_ms, kv, io):
            rows.append(f"| {run.label} | {name} | {backend} | {d:.3f} | {p:.3f} | {k} | {x} |")
        rows.append(f"| {run.label} | KV update | runner | {run.decode_kv_ms:.3f} | {run.prefill_kv_ms:.3f} | | |")
        total_kv = f"{sum(run.kv_bytes) / MB:.2f}" if run.kv_bytes else ""
        rows.append(
            f"| {run.label} | **total** | | {sum(run.decode_ms) + run.decode_kv_ms:.3f} "
            f"({run.decode_tokens_per_s:.1f} tok/s) | {sum(run.prefill_ms) + run.prefill_kv_ms:.3f} "
            f"({run.prefill_tokens_per_s:.1f} tok/s) | {total_kv} | |"
        )
    return "\n".join(rows)


def render(runs: list[RunTimes], png: Path, title: str = "") -> dict:
    """Draw the PNG; returns what was plotted: {phase: {run label: [(segment, ms), ...]}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted: dict[str, dict[str, list[tuple[str, float]]]] = {"decode": {}, "prefill": {}}
    fig, axes = plt.subplots(2, 1, figsize=(11, 2.2 + 1.1 * len(runs) * 2), squeeze=False)
    for ax, phase in zip(axes[:, 0], ("decode", "prefill")):
        totals = []
        for run in runs:
            times = run.decode_ms if phase == "decode" else run.prefill_ms
            kv = run.decode_kv_ms if phase == "decode" else run.prefill_kv_ms
            plotted[phase][run.label] = list(zip(run.shard_labels, times)) + [("KV update", kv)]
            totals.append(sum(times) + kv)
        width = max(max(totals), 1e-9)
        ax.set_xlim(0, width * 1.02)
        # A segment is labelled only where its label fits: about 1.6% of the axis per character.
        char_width = 0.016 * width
        for row, run in enumerate(runs):
            left = 0.0
            for (name, ms), backend in zip(plotted[phase][run.label], run.backends + ["kv"]):
                colour = KV_COLOUR if backend == "kv" else BACKEND_COLOURS.get(backend, "#B279A2")
                hatch = SIMULATED_HATCH if backend == "QnnBackend" and run.qnn_simulated else None
                ax.barh(row, ms, left=left, color=colour, edgecolor="white", hatch=hatch)
                text = "KV" if backend == "kv" else name.split(" ")[0]
                if ms > char_width * (len(text) + 1):
                    ax.text(left + ms / 2, row, text, ha="center", va="center", fontsize=8, color="white")
                left += ms
        speed = [run.decode_tokens_per_s if phase == "decode" else run.prefill_tokens_per_s for run in runs]
        ax.set_yticks(range(len(runs)), [f"{run.label}\n{tps:.1f} tok/s" for run, tps in zip(runs, speed)])
        ax.invert_yaxis()
        ax.set_xlabel(f"{phase}: ms per token (segments: shards in order, then the KV-cache update)")
    present = [b for b in BACKEND_COLOURS if any(b in run.backends for run in runs)]
    simulated = any(run.qnn_simulated and "QnnBackend" in run.backends for run in runs)
    handles = [
        plt.Rectangle(
            (0, 0),
            1,
            1,
            facecolor=BACKEND_COLOURS[b],
            edgecolor="white",
            hatch=SIMULATED_HATCH if b == "QnnBackend" and simulated else None,
        )
        for b in present
    ]
    names = [
        BACKEND_NAMES[b] + (" (x86 simulator: not phone timing)" if b == "QnnBackend" and simulated else "")
        for b in present
    ]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=KV_COLOUR))
    names.append("KV update")
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.suptitle(title or "time per token, by shard")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(png, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {png}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return plotted


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m composite.report", description=__doc__.split(":", 1)[1].strip())
    p.add_argument(
        "stats", nargs="+", help="stats files of composite_runner --stats_json or composite.run --stats-json"
    )
    p.add_argument("--labels", help="comma-separated names for the runs (default: file names)")
    p.add_argument("--png", default="report.png", help="picture to write (default report.png)")
    p.add_argument("--title", default="", help="title over the picture")
    return p.parse_args(argv)


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    labels = args.labels.split(",") if args.labels else [None] * len(args.stats)
    if len(labels) != len(args.stats):
        raise UserError(f"--labels names {len(labels)} runs but {len(args.stats)} stats files were given")
    runs = [read_stats(Path(path), label) for path, label in zip(args.stats, labels)]
    render(runs, Path(args.png), args.title)
    print(markdown_table(runs))
    print(f"\npicture: {args.png}")


if __name__ == "__main__":
    main()
