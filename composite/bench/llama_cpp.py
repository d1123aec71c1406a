"""The second peer: llama.cpp's llama-bench on the benchmark's checkpoint, converted to GGUF.

scripts/build_llama_cpp.sh fetches llama.cpp (from the llama-cpp-python sdist, PyPI being the only
source here) and builds llama-bench and llama-quantize; this module writes the Meta checkpoint as
a Hugging Face folder, converts it with llama.cpp's own convert_hf_to_gguf.py, quantizes it, and
runs llama-bench once per measurement so that runs interleave with the other peers'.

Equal precision: our fp32 / fp16 / 8da8w / 8da4w against GGUF F32 / F16 / Q8_0 / Q4_0 (Q8_0 and
Q4_0 quantize activations to 8 bits in blocks of 32, as 8da* quantize them per token), every
tensor in that type (`--pure`: no higher-precision head or embedding). llama.cpp's KV cache is
float16 in every row: llama-bench offers no float32 cache, so at fp32 and 8da* it moves half the
cache bytes ours does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from composite.errors import UserError

GGUF_TYPES = {"fp32": "F32", "fp16": "F16", "8da8w": "Q8_0", "8da4w": "Q4_0"}
DEFAULT_FOLDER = Path.home() / ".cache" / "composite" / "llama.cpp"


def binaries(folder: Path) -> Path:
    """The folder holding llama-bench and llama-quantize, or one line saying how to build them."""
    bin_dir = folder / "build" / "bin"
    if not (bin_dir / "llama-bench").is_file() or not (folder / "src" / "convert_hf_to_gguf.py").is_file():
        raise UserError(
            f"llama.cpp is not built in {folder}: run bash scripts/build_llama_cpp.sh (or pass --llama-cpp DIR)"
        )
    return bin_dir


def write_hf_folder(paths: dict[str, Path], folder: Path) -> Path:
    """The Meta checkpoint as a transformers LlamaForCausalLM folder (config.json, safetensors,
    tokenizer.model), which is what convert_hf_to_gguf.py reads."""
    import torch
    from safetensors.torch import save_file

    from composite.model.checkpoint import HF_LAYER_NAMES, HF_NAMES, load_checkpoint

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    model = load_checkpoint(str(paths["consolidated.00.pth"]), str(paths["params.json"])).model
    args = model.args
    top = {meta: hf for hf, meta in HF_NAMES.items()}
    inner = {meta: hf for hf, meta in HF_LAYER_NAMES.items()}
    state = {}
    # Our model already holds q/k in Hugging Face's rotate-half order (the loader permutes Meta's).
    for name, tensor in model.state_dict().items():
        if name in top:
            state[top[name]] = tensor.contiguous()
        elif name.startswith("layers."):
            _, index, *module, leaf = name.split(".")
            state[f"model.layers.{index}.{inner['.'.join(module)]}.{leaf}"] = tensor.contiguous()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    save_file({k: v.to(torch.float32) for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "tokenizer.model").write_bytes(paths["tokenizer.model"].read_bytes())
    return folder


def _run(command: list[str], log: Path, what: str, env: dict | None = None) -> None:
    with open(log, "a") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise UserError(f"{what} failed (exit {done.returncode}); see {log}")


def write_gguf(llama_cpp: Path, hf_folder: Path, quant: str, folder: Path) -> Path:
    """GGUF of the checkpoint in the type matching `quant`: converted (F32, F16) or quantized from
    F32 (Q8_0, Q4_0)."""
    folder.mkdir(parents=True, exist_ok=True)
    gguf_type = GGUF_TYPES[quant]
    path = folder / f"model-{gguf_type}.gguf"
    if path.exists():
        return path
    log = folder / "convert.log"
    source = llama_cpp / "src"
    if gguf_type in ("F32", "F16"):
        env = {**os.environ, "PYTHONPATH": f"{source / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        partial = path.with_suffix(".partial")
        _run(
            [
                sys.executable,
                str(source / "convert_hf_to_gguf.py"),
                str(hf_folder),
                "--outtype",
                gguf_type.lower(),
                "--outfile",
                str(partial),
            ],
            log,
            f"llama.cpp's convert_hf_to_gguf.py ({gguf_type})",
            env,
        )
        partial.rename(path)
        return path
    base = write_gguf(llama_cpp, hf_folder, "fp32", folder)
    partial = path.with_suffix(".partial")
    _run(
        [str(binaries(llama_cpp) / "llama-quantize"), "--pure", str(base), str(partial), gguf_type],
        log,
        f"llama-quantize ({gguf_type})",
    )
    partial.rename(path)
    return path


def bench_once(llama_cpp: Path, gguf: Path, quant: str, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    """One prefill of `prompt_tokens` and one decode of `new_tokens` after that many, each timed by
    llama-bench (one repetition, after its warm-up); peak RSS is the larger of the two processes'."""
    bench = binaries(llama_cpp) / "llama-bench"
    common = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    results, peak_kib = [], 0
    for shape in (["-p", str(prompt_tokens), "-n", "0"], ["-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens)]):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(common + shape, stdout=out, stderr=err)
            # wait4, not wait: its rusage is this child's own peak RSS
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            if process.returncode != 0:
                err.seek(0)
                tail = (err.read().strip().splitlines() or ["no output"])[-1]
                raise UserError(f"llama-bench {quant} failed (exit {process.returncode}): {tail}")
            out.seek(0)
            results.append(json.loads(out.read())[0])
        peak_kib = max(peak_kib, usage.ru_maxrss)
    prefill, decode = results
    return {
        "runner": "llama.cpp llama-bench",
        "prompt_tokens": prompt_tokens,
        "generated_tokens": new_tokens,
        "prefill_tokens_per_s": prefill["avg_ts"],
        "decode_tokens_per_s": decode["avg_ts"],
        # llama-bench times prefill alone; the first token comes one decode step after it
        "time_to_first_token_ms": 1e3 * (prompt_tokens / prefill["avg_ts"] + 1 / decode["avg_ts"]),
        "peak_rss_mb": peak_kib / 1024,
    }
