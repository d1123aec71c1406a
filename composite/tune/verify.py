"""composite.tune --verify: the tuned config exported by composite.export and measured by
composite.eval against the float model, each in its own process (the QNN shards on the simulator)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from composite.errors import UserError
from composite.tune.candidates import Candidate


def verify(args, config_path: Path, has_qnn: bool, ctx: int, limit_tokens: int | None) -> dict:
    """The tuned config exported and measured by composite.eval against the float model."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.verify_output or Path(scratch) / "tuned")
        export = [sys.executable, "-m", "composite.export", "--config", str(config_path), "--output", str(folder)]
        if has_qnn:
            export.append("--no-weight-sharing")  # the x86 simulator cannot load weight-shared contexts
        for command in (export,):
            print("$ " + " ".join(command), file=sys.stderr, flush=True)
            done = subprocess.run(command, stdout=sys.stderr)
            if done.returncode != 0:
                raise UserError(f"--verify: the export of {config_path} failed (exit {done.returncode})")
        evaluate = [sys.executable, "-m", "composite.eval", "--artifacts", str(folder), "--text", args.text]
        evaluate += ["--ctx", str(ctx), "--score", args.score, "--reference", "eager", "--json"]
        if limit_tokens:
            evaluate += ["--limit-tokens", str(limit_tokens)]
        print("$ " + " ".join(evaluate), file=sys.stderr, flush=True)
        done = subprocess.run(evaluate, capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"--verify: composite.eval failed: {done.stderr.strip().splitlines()[-1:]}")
        measured = json.loads(done.stdout)
        manifest = json.loads((folder / "manifest.json").read_text())
        files = sum((folder / s["file"]).stat().st_size for s in manifest["shards"])
        return {
            "kld": measured["kld_mean"],
            "top1": measured["top1_agreement"],
            "pte_bytes": files,
            "host_twin": has_qnn,
            "tokens": measured["tokens"],
        }


def verify_chosen(args, best, output: Path) -> dict:
    has_qnn = any(isinstance(c, Candidate) and c.backend == "qnn" for c in best.chosen.choices().values())
    ctx = args.ctx or args.max_seq_len
    verified = verify(args, output, has_qnn, ctx, args.verify_limit_tokens or args.limit_tokens)
    if args.verify_limit_tokens:
        # the PyTorch figure on the tokens the export was measured on, beside the export's
        same_tokens = best.sens.evaluate(best.chosen.choices(), chunk_count=args.verify_limit_tokens // ctx)
        verified["kld_whole_same_tokens"] = same_tokens["kld"]
    return verified
