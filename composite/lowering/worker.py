"""A second process for lowering, so an export keeps both cores of a small machine busy: lowering
is mostly single-threaded Python (graph passes in ExecuTorch and the backends), and shards are
independent until the QNN shards share their spill-fill size.

The worker is a fork of the export, so it shares the loaded model without copying it. It runs one
torch thread: an OpenMP pool the parent already started does not survive a fork (a child's first
parallel op would hang). It writes its shards into the export's staging folder and sends back
their manifest entries; an error in it comes back as the error of the export.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from typing import ClassVar

import torch

from composite.errors import UserError


class ForkedWorker:
    """run(index) for each index, in a forked child; join() -> {index: result}."""

    running: ClassVar[set[int]] = set()  # child pids, for kill_all

    @classmethod
    def kill_all(cls) -> None:
        for pid in list(cls.running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __init__(self, run: Callable[[int], object], indices: list[int]):
        self.indices = indices
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: do the work, report, and leave without running any cleanup
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the export's handler would remove its folder
            os.close(read)
            try:
                torch.set_num_threads(1)
                payload = ("ok", {index: run(index) for index in indices})
            except UserError as e:
                payload = ("user_error", str(e))
            except BaseException as e:
                payload = ("error", "".join(traceback.format_exception(e)))
            with os.fdopen(write, "wb") as out:
                pickle.dump(payload, out)
            os._exit(0)
        ForkedWorker.running.add(self.pid)
        os.close(write)
        self.pipe = os.fdopen(read, "rb")

    def join(self) -> dict[int, object]:
        try:
            status, value = pickle.load(self.pipe)
        except EOFError:
            status, value = "error", "the worker process died"
        except BaseException:  # e.g. SIGTERM while waiting: end the worker now, not when it is done
            self.stop()
            raise
        self.pipe.close()
        os.waitpid(self.pid, 0)
        ForkedWorker.running.discard(self.pid)
        self.pid = None
        if status == "user_error":
            raise UserError(value)
        if status == "error":
            raise RuntimeError(f"lowering shards {self.indices} in a worker process failed:\n{value}")
        return value

    def stop(self) -> None:
        """End the worker early (the export failed or was stopped); once is enough."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass
        ForkedWorker.running.discard(self.pid)
        self.pid = None
        self.pipe.close()


def split_work(weights: dict[int, float], my_load: float = 0.0) -> tuple[list[int], list[int]]:
    """(for this process, for the worker): items go, heaviest first, to whichever side has less
    work so far (this process starting with `my_load`), so the two finish together."""
    mine, theirs, their_load = [], [], 0.0
    for index, weight in sorted(weights.items(), key=lambda item: -item[1]):
        if their_load <= my_load:
            theirs.append(index)
            their_load += weight
        else:
            mine.append(index)
            my_load += weight
    return sorted(mine), sorted(theirs)
