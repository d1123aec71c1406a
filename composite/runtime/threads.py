"""torch's own thread pool held to one thread for a block: where the cores are already another's
(ExecuTorch's threadpool in a runner, the other jobs of an export), more threads only wait."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
