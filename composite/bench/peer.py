"""The peer: ExecuTorch's own llama export (one .pte, XNNPACK, sdpa with KV cache) and its
TextLLMRunner, on the same checkpoint and prompt as ours.

`python -m composite.bench.peer run PTE TOKENIZER PROMPT_FILE NEW_TOKENS SEQ_LEN` runs one
generation in this process and prints one JSON line; the benchmark starts it as a child so each
run gets a fresh process and its own peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from composite.errors import UserError


def export_command(paths: dict[str, Path], max_seq_len: int, quant: str, output: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "executorch.examples.models.llama.export_llama",
        "-c",
        str(paths["consolidated.00.pth"]),
        "-p",
        str(paths["params.json"]),
        "-X",
        "-kv",
        "--use_sdpa_with_kv_cache",
        "-d",
        "fp16" if quant == "fp16" else "fp32",
        "--max_seq_length",
        str(max_seq_len),
        "--max_context_length",
        str(max_seq_len),
        "--output_name",
        str(output),
    ]
    if quant == "8da4w":
        command += ["-qmode", "8da4w", "-G", "32"]
    return command


def export(paths: dict[str, Path], max_seq_len: int, quant: str, output: Path, log: Path) -> None:
    with open(log, "w") as out:
        done = subprocess.run(
            export_command(paths, max_seq_len, quant, output), stdout=out, stderr=subprocess.STDOUT, cwd=output.parent
        )
    if done.returncode != 0 or not output.exists():
        raise UserError(f"ExecuTorch's llama export failed (exit {done.returncode}); see {log}")


def _vm_kib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return 0.0


def _run(pte: str, tokenizer: str, prompt_file: str, new_tokens: int, seq_len: int) -> dict:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama::custom_sdpa / update_cache
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    # Python, torch and the bindings are not the runner: their resident memory is measured here
    # and reported beside the peak so the comparison with a C++ process is fair.
    baseline_kib = _vm_kib("VmRSS")
    runner = TextLLMRunner(pte, tokenizer)
    report: dict = {}

    def on_stats(stats) -> None:
        report.update(
            {
                name: getattr(stats, name)
                for name in dir(stats)
                if not name.startswith("_") and isinstance(getattr(stats, name), (int, float))
            }
        )

    # One BOS, as composite_runner gets it in its prompt ids: both see the same tokens.
    config = GenerationConfig(max_new_tokens=new_tokens, seq_len=seq_len, temperature=0.0, echo=False, num_bos=1)
    runner.generate(Path(prompt_file).read_text(), config, lambda _text: None, on_stats)
    # The runner's stats are whole milliseconds; a tiny model's prompt can take less than one, so
    # a zero is counted as one (the speed printed is then a lower bound).
    prefill_s = max(report["prompt_eval_end_ms"] - report["inference_start_ms"], 1) / 1e3
    decode_s = max(report["inference_end_ms"] - report["prompt_eval_end_ms"], 1) / 1e3
    generated = report["num_generated_tokens"]
    return {
        "runner": "executorch TextLLMRunner",
        "prompt_tokens": report["num_prompt_tokens"],
        "generated_tokens": generated,
        "load_ms": report["model_load_end_ms"] - report["model_load_start_ms"],
        "time_to_first_token_ms": report["first_token_ms"] - report["inference_start_ms"],
        "prefill_tokens_per_s": report["num_prompt_tokens"] / prefill_s,
        # Same definition as composite_runner: decode calls after the first token over their time.
        "decode_tokens_per_s": (generated - 1) / decode_s if generated > 1 else 0.0,
        "peak_rss_mb": _vm_kib("VmHWM") / 1024,
        "interpreter_rss_mb": baseline_kib / 1024,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 6 or argv[0] != "run":
        print("usage: python -m composite.bench.peer run PTE TOKENIZER PROMPT_FILE NEW_TOKENS SEQ_LEN", file=sys.stderr)
        return 2
    print(json.dumps(_run(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
