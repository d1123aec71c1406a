"""Where an export's time goes, from py-spy's raw profile of it (on demand; pip install py-spy):

    py-spy record --subprocesses --format raw -r 10 -o export.raw -- \\
        python -m composite.export --config configs/smollm2.yaml --no-weight-sharing --no-cache
    python scripts/export_stages.py export.raw

Each sample is counted once, under the first stage (in the table's order) found in its stack;
samples in both processes of a parallel export are added up, so the total is CPU time, not wall
time. Prints a markdown table.
"""

from __future__ import annotations

import argparse
from collections import Counter

# (stage, the functions that mark it), most specific first: a sample inside the XNNPACK backend's
# preprocess counts there even though to_edge_transform_and_lower is also on its stack.
STAGES = [
    ("checkpoint read", ("load_checkpoint", "float_shard")),
    ("shard cache (keys, lookups, stores)", ("export_keys", "ShardCache.get", "ShardCache.put")),
    ("float passes (calibration inputs)", ("float_task", "replay")),
    ("QNN quantizer (prepare, convert)", ("prepare_pt2e", "convert_pt2e")),
    ("SQNR measure (simulator)", ("measure",)),
    ("QNN spill-fill sharing", ("settle", "own_spill_fill")),
    ("partitioning", ("XnnpackPartitioner.partition", "QnnPartitioner.partition", "Partitioner.partition")),
    ("XNNPACK preprocess: graph passes", ("XNNPACKPassManager.transform",)),
    ("XNNPACK preprocess: serialization", ("XnnpackBackend.preprocess",)),
    ("QNN preprocess (HTP compile)", ("QnnBackend.preprocess", "QnnBackend.preprocess_multimethod")),
    ("torch.export", ("export_methods", "_export", "export")),
    (
        "to_edge (decompositions, edge passes)",
        ("_gen_edge_manager_for_partitioners", "to_edge", "EdgeProgramManager.transform"),
    ),
    ("program serialization (to_executorch)", ("EdgeProgramManager.to_executorch",)),
    ("write + manifest check", ("write_shard",)),
]


def stage_of(frames: list[str]) -> str:
    names = {frame.split(" (")[0] for frame in frames}
    for stage, markers in STAGES:
        if any(marker in names for marker in markers):
            return stage
    return "other (imports, model building, tokenizer, summary)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profiles", nargs="+", help="py-spy --format raw files")
    p.add_argument("--rate", type=float, default=10.0, help="py-spy's sampling rate (-r), samples per second")
    args = p.parse_args()
    seconds: Counter = Counter()
    for path in args.profiles:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if stack:
                    seconds[stage_of(stack.split(";"))] += int(count) / args.rate
    total = sum(seconds.values())
    print("| stage | CPU s | share |")
    print("|---|---:|---:|")
    for stage, _ in [*STAGES, ("other (imports, model building, tokenizer, summary)", ())]:
        if seconds[stage]:
            print(f"| {stage} | {seconds[stage]:.1f} | {seconds[stage] / total:.0%} |")
    print(f"| **all** | {total:.1f} | |")


if __name__ == "__main__":
    main()
