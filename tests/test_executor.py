"""A forked call gives back what its child returned or raised, as the caller's own."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

import pytest

from composite.errors import UserError
from composite.executor.fork import ForkedCall, ProcessDied, split_work
from composite.memory import PeakMemory


def write_to_a_full_disk(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def refuse():
    raise UserError("shard 2 does not fit")


def fail():
    raise KeyError("layers.3.wq")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_call_returns_its_childs_result_from_its_own_process():
    assert ForkedCall(lambda a, b: (a + b, os.getpid()), (2, 3)).result()[0] == 5
    assert ForkedCall(os.getpid).result() != os.getpid()


def test_an_os_error_in_the_child_is_the_same_os_error_in_the_caller():
    with pytest.raises(OSError) as raised:
        ForkedCall(write_to_a_full_disk, ("artifacts/shard_3.pte",)).result()
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == "artifacts/shard_3.pte"
    with pytest.raises(FileNotFoundError):  # the errno picks the subclass, as for the caller's own
        ForkedCall(open, ("/nonexistent/weights.safetensors",)).result()


def test_a_user_error_stays_one_line_and_other_errors_carry_the_childs_traceback():
    with pytest.raises(UserError, match=r"^shard 2 does not fit$"):
        ForkedCall(refuse).result()
    with pytest.raises(RuntimeError, match=r"(?s)Traceback.*in fail.*KeyError: 'layers.3.wq'"):
        ForkedCall(fail).result()


def test_a_child_killed_mid_call_is_reported_with_its_signal():
    call = ForkedCall(die)
    with pytest.raises(ProcessDied, match=r"killed by signal 9 \(SIGKILL\), most likely by the out-of-memory killer"):
        call.result()
    assert call.pid is None and not ForkedCall.running


def die_in_a_fork_of_its_own():
    return ForkedCall(die).result()


def test_a_fork_of_a_forked_call_that_dies_is_the_callers_process_died():
    with pytest.raises(ProcessDied, match=r"^killed by signal 9 \(SIGKILL\), most likely by the out-of-memory killer$"):
        ForkedCall(die_in_a_fork_of_its_own).result()


def wait_in_a_fork_of_its_own(pid_file):
    inner = ForkedCall(time.sleep, (600,))
    pid_file.write_text(str(inner.pid))
    return inner.result()


def test_a_forked_call_killed_takes_its_own_forks_with_it(tmp_path):
    pid_file = tmp_path / "inner.pid"
    outer = ForkedCall(wait_in_a_fork_of_its_own, (pid_file,))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    inner = int(pid_file.read_text())
    outer.stop()  # SIGKILL, as a stopped export ends its jobs
    try:
        while Path(f"/proc/{inner}").exists() and "State:\tZ" not in Path(f"/proc/{inner}/status").read_text():
            assert time.monotonic() < deadline, "the inner fork outlived the call that made it"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(inner, signal.SIGKILL)


def hold(size: int) -> None:
    held = bytearray(b"\x01") * size  # written, so resident
    time.sleep(1.0)
    del held


def hold_in_a_fork_of_its_own(size: int) -> int:
    return ForkedCall(hold, (size,)).result()


def test_a_jobs_peak_memory_counts_the_forks_it_makes():
    size = 600 << 20
    memory = PeakMemory()
    outer = ForkedCall(hold_in_a_fork_of_its_own, (size,))
    pid = outer.pid
    for _ in range(15):  # past the second the inner fork holds its bytes
        memory.sample()
        time.sleep(0.1)
    outer.result()
    assert memory.peak_of(pid) > size
    assert memory.peak >= memory.peak_of(pid) > memory.peak_of(os.getpid())


def test_peak_memory_reads_a_brief_rise_at_once():
    """PSS is read seldom where reading it costs (here: not again for minutes), but a rise of the
    tree's resident bytes is read at once: a job that holds 400 MB for a second is seen."""
    size = 400 << 20
    with PeakMemory(interval=0.05, wait_per_read_cost=10_000) as memory:
        time.sleep(0.5)  # past its first reading: the next is not due for minutes
        job = ForkedCall(hold, (size,))
        pid = job.pid
        job.result()
        seen = memory.peak_of(pid)
    assert seen is not None and seen > size


def test_split_work_gives_the_heaviest_item_to_whichever_side_has_less_so_far():
    # 5 -> theirs (0 <= 1), 4 -> mine (1 + 4), 3 -> theirs (5 <= 5), 2 -> mine (8 > 5), 2 -> mine (8 > 7)
    assert split_work({0: 5.0, 1: 4.0, 2: 3.0, 3: 2.0, 4: 2.0}, my_load=1.0) == ([1, 3, 4], [0, 2])
    assert split_work({7: 0.5}) == ([], [7])
