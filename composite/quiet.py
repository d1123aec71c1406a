"""Keep third-party start-up chatter (torchao's optional CUDA kernels, deprecation warnings) out of
the CLIs' output, where it would bury the one line that matters."""

from __future__ import annotations

import logging
import os
import warnings


def silence_library_noise() -> None:
    os.environ.setdefault("TORCHINDUCTOR_DISABLE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    # ExecuTorch's QNN partitioner and preprocessor log every node at INFO on the root logger.
    logging.disable(logging.WARNING)
    for name in ("torchao", "torch._export", "torch.export", "executorch", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
