"""Keep third-party chatter out of the CLIs' output, where it would bury the one line that matters.

Two kinds: Python-level (torchao's optional CUDA kernels, deprecation warnings, ExecuTorch's
partitioner logging every node) is silenced through `warnings` and `logging`; native libraries
(the QNN backend and libraries, ExecuTorch's CPU probe) write to file descriptor 2 directly, so
`filtered_native_stderr` puts a pipe there and drops their known routine lines. Everything else,
and every line when verbose, still reaches the terminal: a real error is never hidden.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings

# Routine lines of libraries we load, each removed up to its line end wherever it starts (a
# progress bar without a newline may precede it). runner_cpp/stderr_filter.cpp holds the same list
# for composite_runner.
ROUTINE_NATIVE_LINE = re.compile(
    rb"(?:\[INFO\] \[Qnn ExecuTorch\]"
    rb"|\[WARNING\] \[Qnn ExecuTorch\]: Qnn API version \S+ is used\. The version is tested against"
    rb"|\[ERROR\] \[Qnn ExecuTorch\]:\s+<E> unexpected GraphHtpSettings option 66"
    rb"| ?# LIBNATIVE:"
    rb"|\[cpuinfo_utils\.cpp:\d+\])[^\r\n]*(?:\r?\n)*"  # some end in a blank line of their own
)
# Text that may be the start of such a line is held back until its line is complete.
MAYBE_ROUTINE_START = (b"[", b" ", b"#")


def silence_library_noise() -> None:
    os.environ.setdefault("TORCHINDUCTOR_DISABLE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    # ExecuTorch's QNN partitioner and preprocessor log every node at INFO on the root logger.
    logging.disable(logging.WARNING)
    for name in ("torchao", "torch._export", "torch.export", "executorch", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def strip_routine(text: bytes, after_routine: bool = False) -> tuple[bytes, bool]:
    """(text without routine lines, whether it ended with one). `after_routine`: the text before
    this ended with one, so blank lines it begins with belong to that line."""
    if after_routine:
        text = text.lstrip(b"\n")
    stripped = ROUTINE_NATIVE_LINE.sub(b"", text)
    ends_with_routine = any(m.end() == len(text) for m in ROUTINE_NATIVE_LINE.finditer(text))
    return stripped, ends_with_routine or (after_routine and not text)


_unfiltered_stderr: int | None = None  # the real stderr while filtered_native_stderr is active


def say_at_once(line: str) -> None:
    """Write one line to the real stderr now, past the filter's thread: for a process about to
    leave with os._exit, which gives that thread no time to forward it."""
    os.write(2 if _unfiltered_stderr is None else _unfiltered_stderr, (line + "\n").encode())


@contextlib.contextmanager
def filtered_native_stderr(verbose: bool = False):
    """Inside: fd 2 is a pipe whose lines are forwarded to the real stderr unless routine.
    Python's own sys.stderr goes through it too, so the order of lines is kept."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    real_stderr = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    forward_to = os.dup(real_stderr)  # the thread's own copy: `real_stderr` is closed on the way out
    global _unfiltered_stderr
    _unfiltered_stderr = real_stderr

    def forward():
        with os.fdopen(read_end, "rb") as pipe, os.fdopen(forward_to, "wb", buffering=0) as out:
            pending, after_routine = b"", False
            while chunk := pipe.read1(65536):
                pending += chunk
                cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
                if not pending[cut:].startswith(MAYBE_ROUTINE_START):
                    cut = len(pending)  # e.g. a progress bar's redraw: show it now
                text, after_routine = strip_routine(pending[:cut], after_routine)
                out.write(text)
                pending = pending[cut:]
            out.write(strip_routine(pending, after_routine)[0])

    thread = threading.Thread(target=forward, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        _unfiltered_stderr = None
        os.dup2(real_stderr, 2)  # closes the pipe's last write end: the thread sees end of file
        os.close(real_stderr)
        thread.join(timeout=10)
