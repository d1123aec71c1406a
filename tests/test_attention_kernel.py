"""composite::attention: the C++ kernel (libcomposite_kernels.so) against the reference, the
reference against the model's own attention, and exports that use it in both runners."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from composite.manifest import MASK_HIDDEN, read
from composite.model.llama import Attention, ModelArgs, rope_cos_sin
from composite.ops.attention import kernel_library, load_kernels, reference
from composite.runtime.kv_cache import AttentionMask
from conftest import RUNNER, one_error_line, run_cli

S = 16  # cache slots
# kv heads, query heads per kv head, head dim; Llama 3.2 3B's heads: 8 KV heads of 3 query heads, 128 wide
SHAPES = {"MHA": (2, 1, 8), "GQA": (2, 3, 8), "odd": (1, 2, 6), "llama3.2-3b": (8, 3, 128)}


class OneAttention(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, k_new, v_new, mask):
        return torch.ops.composite.attention(q, k_cache, v_cache, k_new, v_new, mask)


def inputs(kv: int, rep: int, hd: int, t: int, valid: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv, rep * t, hd, generator=g) / hd**0.5
    k_cache, v_cache = torch.randn(kv, hd, S, generator=g), torch.randn(kv, S, hd, generator=g)
    k_new, v_new = torch.randn(kv, hd, t, generator=g), torch.randn(kv, t, hd, generator=g)
    mask = AttentionMask(t, S, MASK_HIDDEN).at(valid).clone()
    return q, k_cache, v_cache, k_new, v_new, mask


@pytest.fixture(scope="module")
def kernels_loaded():
    if kernel_library() is None:
        pytest.fail("libcomposite_kernels.so is not built (bash scripts/build_runner.sh build)")
    load_kernels()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t", [1, 6])
def test_kernel_equals_the_reference(kernels_loaded, shape, t):
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    kv, rep, hd = SHAPES[shape]
    example = inputs(kv, rep, hd, t, 0, seed=0)
    with torch.no_grad():
        program = to_edge(torch.export.export(OneAttention(), example)).to_executorch()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    for valid in (0, 1, S - 1, S):
        case = inputs(kv, rep, hd, t, valid, seed=valid + 1)
        actual = method.execute(list(case))[0]
        expected = reference(*case)
        worst = (actual - expected).abs().max().item()
        assert worst <= 1e-5, f"{shape} T={t} valid={valid}: max abs {worst}"


@pytest.mark.parametrize("t", [1, 6])
def test_float16_kernel_is_the_float32_attention_of_its_inputs_rounded_once(kernels_loaded, t):
    """An fp16 shard's call: every tensor float16. The kernel sums in float32 and rounds only its
    output, so it is the float32 reference of the same values to within float16's half-ulp."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    kv, rep, hd = SHAPES["GQA"]
    example = tuple(x.half() for x in inputs(kv, rep, hd, t, 0, seed=0))
    with torch.no_grad():
        program = to_edge(torch.export.export(OneAttention(), example)).to_executorch()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    for valid in (0, 1, S - 1, S):
        case = tuple(x.half() for x in inputs(kv, rep, hd, t, valid, seed=valid + 1))
        actual = method.execute(list(case))[0]
        assert actual.dtype == torch.float16
        expected = reference(*(x.float() for x in case))
        assert torch.allclose(actual.float(), expected, rtol=2**-11, atol=1e-4), f"T={t} valid={valid}"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_reference_equals_the_models_masked_attention(shape):
    from composite.lowering.xnnpack import KernelAttention

    kv, rep, hd = SHAPES[shape]
    args = ModelArgs(dim=32, n_layers=1, n_heads=kv * rep, n_kv_heads=kv, vocab_size=8, hidden_dim=64, head_dim=hd)
    torch.manual_seed(0)
    attention = Attention(args).eval()
    t, valid = 5, 9
    x = torch.randn(1, t, args.dim)
    cos, sin = rope_cos_sin(1.0 / (10000 ** (torch.arange(0, hd, 2) / hd)), torch.arange(valid, valid + t))
    mask = AttentionMask(t, S, MASK_HIDDEN).at(valid)
    caches = torch.randn(kv, hd, S), torch.randn(kv, S, hd)
    with torch.no_grad():
        expected = attention(x, cos, sin, mask, *caches)
        actual = KernelAttention(attention)(x, cos, sin, mask, *caches)
    for e, a in zip(expected, actual):
        assert (e - a).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def kernel_export(llama3_exports):
    """The Llama-3-style model (GQA, 5 layers) in 3 shards with composite::attention (the default)."""
    manifest = read(llama3_exports[3])
    assert all(s["placement"]["options"]["attention"] == "kernel" for s in manifest["shards"])
    return llama3_exports[3]


def test_an_export_with_the_kernel_gives_the_eager_model_in_both_runners(kernel_export, tmp_path):
    from test_chain_matches_eager import compare

    manifest = compare(kernel_export)  # logits within 1e-4 of the eager model, tokens identical
    for shard in manifest["shards"]:
        if shard["layers"][1] > shard["layers"][0]:
            # decode calls the kernel between XNNPACK delegates, one more per layer; prefill keeps
            # XNNPACK's batched matmuls, its layers inside no more delegates
            layers = shard["layers"][1] - shard["layers"][0]
            assert "composite::attention.out" in shard["cpu_ops"]["decode"]
            assert "composite::attention.out" not in shard["cpu_ops"]["prefill"]
            decode, prefill = (shard["delegates"][m]["XnnpackBackend"] for m in ("decode", "prefill"))
            assert decode >= layers + 1 and prefill <= decode, shard["delegates"]
    args = ["--artifacts", str(kernel_export), "--prompt_ids", "1,17,230,45,99,7", "--max_new_tokens", "24"]
    stats = tmp_path / "stats.json"
    cpp = subprocess.run([str(RUNNER), *args, "--stats_json", str(stats)], capture_output=True, text=True)
    assert cpp.returncode == 0, cpp.stderr
    python = json.loads(run_cli("composite.run", *args, "--json", check=True).stdout)
    reference_run = json.loads(run_cli("composite.run", *args, "--json", "--reference", check=True).stdout)
    assert json.loads(stats.read_text())["tokens"] == python["tokens"] == reference_run["tokens"]


def test_without_the_kernel_library_one_line_names_the_operator(kernel_export, tmp_path):
    import os

    env = {**os.environ, "COMPOSITE_KERNELS": str(tmp_path / "missing.so")}
    result = run_cli("composite.run", "--artifacts", str(kernel_export), "--prompt-ids", "1,2", env=env)
    assert "composite::attention.out" in one_error_line(result)
