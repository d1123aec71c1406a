"""composite::attention: the attention of an XNNPACK shard's layer over the runner's cache.

A call's T tokens attend to the cache's valid slots and, causally, to their own new entries. The
valid slots are the cache columns the runner's mask leaves visible before its first hidden one
(the runner's mask shows slots 0 .. pos-1 to a call at position pos). The graph's masked matmuls read
all S slots and XNNPACK repacks the cache operand on every call; the kernel reads only the valid
prefix. Shapes (GQA folded as the model folds it: row r * T + i is head g * rep + r, token i):
  q [kv, rep*T, hd] (scaled), k_cache [kv, hd, S], v_cache [kv, S, hd], k_new [kv, hd, T],
  v_new [kv, T, hd], mask [T, S+T] (0 visible, hidden otherwise)  ->  [kv, rep*T, hd]

In PyTorch the operator runs `reference` below; in ExecuTorch, the C++ kernel of
runner_cpp/kernels/attention.cpp (libcomposite_kernels.so), which composite_runner links and
`load_kernels()` loads into ExecuTorch's Python runtime.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from composite.errors import UserError

OPERATOR = "composite::attention.out"
LIBRARY = "libcomposite_kernels.so"
_library = torch.library.Library("composite", "DEF")
_library.define(
    "attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_new, Tensor v_new, Tensor mask) -> Tensor"
)
_library.define(
    "attention.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_new, Tensor v_new, Tensor mask, *, "
    "Tensor(a!) out) -> Tensor(a!)"
)


def valid_slots(mask: torch.Tensor, cache_slots: int) -> int:
    """How many leading cache columns the mask's first row leaves visible."""
    hidden = (mask[0, :cache_slots] != 0).nonzero()
    return int(hidden[0]) if len(hidden) else cache_slots


def reference(q, k_cache, v_cache, k_new, v_new, mask) -> torch.Tensor:
    valid = valid_slots(mask, k_cache.shape[-1])
    t = k_new.shape[-1]
    rows = q.shape[1]
    scores = torch.cat((torch.bmm(q, k_cache[..., :valid]), torch.bmm(q, k_new)), dim=-1)
    token = torch.arange(rows) % t  # each row's token within the call
    hidden = torch.arange(t)[None, :] > token[:, None]
    scores[..., valid:] = scores[..., valid:].masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs[..., :valid], v_cache[:, :valid]) + torch.bmm(probs[..., valid:], v_new)


@torch.library.impl(_library, "attention", "CompositeExplicitAutograd")
def _attention(q, k_cache, v_cache, k_new, v_new, mask):
    return reference(q, k_cache, v_cache, k_new, v_new, mask)


@torch.library.impl(_library, "attention.out", "CompositeExplicitAutograd")
def _attention_out(q, k_cache, v_cache, k_new, v_new, mask, *, out):
    out.copy_(reference(q, k_cache, v_cache, k_new, v_new, mask))
    return out


@torch.library.register_fake("composite::attention")
def _attention_fake(q, k_cache, v_cache, k_new, v_new, mask):
    return torch.empty_like(q)


def kernel_library() -> Path | None:
    """Where libcomposite_kernels.so is: $COMPOSITE_KERNELS when set, else the runner's build folder."""
    named = os.environ.get("COMPOSITE_KERNELS")
    path = Path(named) if named else Path(__file__).resolve().parents[2] / "build" / LIBRARY
    return path if path.is_file() else None


def load_kernels() -> None:
    """Registers our kernels with ExecuTorch's Python runtime (once; before a program needs them)."""
    from executorch.extension.pybindings import portable_lib

    if OPERATOR in portable_lib._get_operator_names():
        return
    path = kernel_library()
    if path is None:
        raise UserError(
            f"this export uses operator {OPERATOR}, whose kernel is in {LIBRARY}, which is not at "
            f"{os.environ.get('COMPOSITE_KERNELS') or 'build/'}: build it (bash scripts/build_runner.sh build) or point "
            "COMPOSITE_KERNELS at it"
        )
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
