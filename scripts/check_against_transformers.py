"""An export of a GGUF checkpoint against transformers' own loading of that GGUF, on demand (the
tests do the same on GGUF files they write; this runs it on a trained model):

    python scripts/check_against_transformers.py --artifacts DIR --gguf FILE [--runner build/composite_runner]

1. a text prompt's greedy continuation (32 tokens) from composite_runner and composite.run equals
   transformers' generate;
2. a three-turn chat with a system message, in both runners: at every turn the ids the runner fed
   equal apply_chat_template(conversation so far, add_generation_prompt=True), and each answer is
   transformers' greedy continuation of the same context;
3. with --text: the export's perplexity (composite.eval) against transformers' on the same tokens
   and chunks, within 1% (--ctx 512, the first --limit-tokens 2048 tokens, second half scored).
Prints what it compared; exits 1 on the first difference. Needs the test extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The three primary colors are"
SYSTEM = "You are a concise geography tutor."
TURNS = ["What is the capital of France?", "And of Germany?", "Which of the two is larger?"]
ANSWER_TOKENS = 40


def runner_command(runner: str, binary: Path, *args: str) -> list[str]:
    if runner == "cpp":
        return [str(binary), *args]
    python_args = [a.replace("_", "-") if a.startswith("--") else a for a in args]
    return [sys.executable, "-m", "composite.run", *python_args]


def run(command: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr}")


def greedy(model, ids: list[int], new_tokens: int, stops: list[int] | None = None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops)
    return out[0, len(ids) :].tolist()


def check(what: str, ours, theirs) -> None:
    if ours != theirs:
        sys.exit(f"DIFFERENT: {what}\n  ours:         {ours}\n  transformers: {theirs}")
    print(f"equal: {what}")


def transformers_perplexity(model, artifacts: Path, text: Path, ctx: int, limit: int) -> tuple[float, int]:
    """Perplexity of transformers' model on composite.eval's chunks, scoring their second halves."""
    from composite.eval.scoring import chunks, eval_tokens, first_scored
    from composite.tokenizer import Tokenizer

    manifest = json.loads((artifacts / "manifest.json").read_text())
    tokenizer = Tokenizer(artifacts / manifest["tokenizer"]["file"])
    pieces = chunks(eval_tokens(tokenizer, text.read_text(), limit), ctx, manifest.get("bos_id"))
    first = first_scored(ctx, "second-half")
    nll, count = 0.0, 0
    with torch.no_grad():
        for chunk in pieces:
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), dim=-1)
            nll -= sum(float(logp[p - 1, chunk[p]]) for p in range(first, ctx))
            count += ctx - first
    return math.exp(nll / count), count


def check_perplexity(model, artifacts: Path, text: Path) -> None:
    flags = ["--ctx", "512", "--limit-tokens", "2048", "--score", "second-half", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "composite.eval", "--artifacts", str(artifacts), "--text", str(text), *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if done.returncode != 0:
        sys.exit(f"composite.eval failed:\n{done.stderr}")
    ours = json.loads(done.stdout)
    theirs, count = transformers_perplexity(model, artifacts, text, 512, 2048)
    ratio = ours["perplexity"] / theirs
    print(
        f"perplexity over {count} tokens: ours {ours['perplexity']:.4f}, transformers {theirs:.4f} (ratio {ratio:.5f})"
    )
    if count != ours["tokens"] or abs(ratio - 1) > 0.01:
        sys.exit("DIFFERENT: perplexity beyond 1% of transformers'")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--runner", default=str(REPO / "build" / "composite_runner"))
    p.add_argument("--text", help="also compare perplexity on this text")
    args = p.parse_args()
    gguf = Path(args.gguf).resolve()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    ).eval()
    manifest = json.loads((Path(args.artifacts) / "manifest.json").read_text())
    stops = sorted(manifest["eos_ids"])
    if args.text:
        check_perplexity(model, Path(args.artifacts), Path(args.text))
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.json"
        for runner in ("cpp", "python"):
            flags = ("--artifacts", args.artifacts, "--max_new_tokens", "32", "--temperature", "0")
            run(runner_command(runner, Path(args.runner), *flags, "--prompt", PROMPT, "--stats_json", str(stats)))
            fed = json.loads(stats.read_text())
            ours = fed["tokens"]
            prompt_ids = [manifest["bos_id"]] if manifest.get("bos_id") is not None else []
            prompt_ids += tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
            check(f"{runner}: the prompt's ids", len(prompt_ids), fed["prompt_tokens"])
            check(f"{runner}: 32 greedy tokens after {PROMPT!r}", ours, greedy(model, prompt_ids, len(ours)))

            chat = ("--artifacts", args.artifacts, "--chat", "--system", SYSTEM, "--temperature", "0")
            command = runner_command(runner, Path(args.runner), *chat, "--max_new_tokens", str(ANSWER_TOKENS))
            run([*command, "--stats_json", str(stats)], stdin="\n".join(TURNS) + "\n")
            turns = json.loads(stats.read_text())["turns"]
            context: list[int] = []  # the template's tokens, answers left out
            cache: list[int] = []  # what the runner's KV cache holds
            for k, turn in enumerate(turns):
                prompt = list(turn["prompt"])
                if k and turns[k - 1]["tokens"][-1] not in stops:
                    prompt = prompt[1:]  # the cut-short answer's last token, fed with this turn
                context += prompt
                messages = [{"role": "system", "content": SYSTEM}]
                for j, question in enumerate(TURNS[: k + 1]):
                    messages.append({"role": "user", "content": question})
                    if j < k:
                        messages.append({"role": "assistant", "content": ""})
                expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
                check(f"{runner}: turn {k + 1}'s ids against apply_chat_template", context, expected["input_ids"])
                cache += turn["prompt"]
                answer = greedy(model, cache, len(turn["tokens"]), stops)
                check(f"{runner}: turn {k + 1}'s answer {tokenizer.decode(turn['tokens'])!r}", turn["tokens"], answer)
                cache += turn["tokens"][:-1]


if __name__ == "__main__":
    main()
