"""The stderr filter of the CLIs: routine native lines dropped, everything else kept, in order."""

from __future__ import annotations

import os
import threading

from composite.quiet import filtered_native_stderr, strip_routine


def test_routine_lines_go_and_everything_else_stays():
    text = (
        b"\rlowering shards:  33%|###\n"
        b"[INFO] [Qnn ExecuTorch]: Creating new backend bundle.\n"
        b"[ERROR] [Qnn ExecuTorch]:  <E> unexpected GraphHtpSettings option 66\n\n"
        b"[ERROR] [Qnn ExecuTorch]: Failed to load the context\n"
        b"[cpuinfo_utils.cpp:87] Failed to open midr file\n"
        b"note: shard 1: calibrated\n"
    )
    kept, _ = strip_routine(text)
    assert (
        kept
        == b"\rlowering shards:  33%|###\n[ERROR] [Qnn ExecuTorch]: Failed to load the context\nnote: shard 1: calibrated\n"
    )


def test_leaving_at_once_never_breaks_the_forwarding_thread(tmp_path):
    """An error raised right after entering (a bad --output) used to close the descriptor the
    forwarding thread was about to copy."""
    failures = []
    previous = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)
    saved = os.dup(2)
    try:
        with open(tmp_path / "stderr.txt", "wb") as sink:
            os.dup2(sink.fileno(), 2)
            for i in range(200):
                with filtered_native_stderr():
                    if i % 2:
                        os.write(2, b"[INFO] [Qnn ExecuTorch]: routine\nkept\n")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        threading.excepthook = previous
    assert failures == []
    assert (tmp_path / "stderr.txt").read_bytes() == b"kept\n" * 100
