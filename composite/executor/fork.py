"""A call in a forked child process: the local way to run a task on another core.

The child is a fork of the caller, so it sees the caller's memory (a task's inputs) without a copy.
It runs one torch thread: an OpenMP pool the parent already started does not survive a fork (a
child's first parallel op would hang). Its result comes back pickled through a pipe; an error in
it comes back as the error of the call; a child that dies (killed by the out-of-memory killer,
say) is reported as such (ProcessDied), with how it died.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from typing import ClassVar

import torch

from composite.errors import UserError


class ProcessDied(Exception):
    """A forked call's process ended without a result. how: how it died, as a clause ("killed by
    signal 9 ..."); a call's process whose own fork died passes that on as its error."""

    def __init__(self, how: str):
        self.how = how
        super().__init__(how)

    @classmethod
    def from_status(cls, status: int) -> ProcessDied:
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            how = f"killed by signal {number} ({signal.Signals(number).name})"
            if number == signal.SIGKILL:
                how += ", most likely by the out-of-memory killer"
        else:
            how = f"exited with status {os.WEXITSTATUS(status)} before sending its result"
        return cls(how)


def as_message(e: BaseException) -> tuple[str, object]:
    """An error in a child process as (kind, value), picklable whatever the error held."""
    if isinstance(e, UserError):
        return "user_error", str(e)
    if isinstance(e, ProcessDied):
        return "process_died", e.how
    if isinstance(e, OSError) and e.errno is not None:  # a full disk or a missing file: the caller's one line
        return "os_error", (e.errno, e.strerror, e.filename)
    return "error", "".join(traceback.format_exception(e))


def raise_message(kind: str, value) -> None:
    """The error as_message described, raised in the caller as if it were its own."""
    if kind == "user_error":
        raise UserError(value)
    if kind == "process_died":
        raise ProcessDied(value)
    if kind == "os_error":
        raise OSError(*value)
    raise RuntimeError(value)


class ForkedCall:
    """fn(*args) in a forked child; result() -> its return value (or its exception)."""

    running: ClassVar[set[int]] = set()  # child pids, for kill_all

    @classmethod
    def kill_all(cls) -> None:
        for pid in list(cls.running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __init__(self, fn: Callable, args: tuple = ()):
        read, write = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # the child: do the work, report, and leave without running any cleanup
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the export's handler would remove its folder
            end_with_parent(parent)
            os.close(read)
            try:
                torch.set_num_threads(1)
                payload = ("ok", fn(*args))
            except BaseException as e:
                payload = as_message(e)
            try:
                with os.fdopen(write, "wb") as out:
                    pickle.dump(payload, out, protocol=pickle.HIGHEST_PROTOCOL)
            finally:
                os._exit(0)
        ForkedCall.running.add(self.pid)
        os.close(write)
        self.pipe = os.fdopen(read, "rb")

    def fileno(self) -> int:
        """Readable once the child is done (multiprocessing.connection.wait takes it)."""
        return self.pipe.fileno()

    def result(self):
        try:
            status, value = pickle.load(self.pipe)
        except EOFError:
            status, value = "died", None
        except BaseException:  # e.g. SIGTERM while waiting: end the child now, not when it is done
            self.stop()
            raise
        self.pipe.close()
        _, exit_status = os.waitpid(self.pid, 0)
        ForkedCall.running.discard(self.pid)
        self.pid = None
        if status == "died":
            raise ProcessDied.from_status(exit_status)
        if status != "ok":
            raise_message(status, value)
        return value

    def stop(self) -> None:
        """End the child early (the caller failed or was stopped); once is enough."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass
        ForkedCall.running.discard(self.pid)
        self.pid = None
        self.pipe.close()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(parent: int) -> None:
    """This process gets SIGKILL when `parent`, the one that forked it, ends: a job killed by a
    stopped export (kill_all) takes the fork it is waiting on with it. Linux ties this to the thread
    that forked, which here is always a process's main thread. No-op where libc has no prctl."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the request took hold
        os._exit(1)


def split_work(weights: dict[int, float], my_load: float = 0.0) -> tuple[list[int], list[int]]:
    """(for this process, for the other): items go, heaviest first, to whichever side has less
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
