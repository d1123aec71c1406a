"""How much memory a run holds: the summed PSS of a process and all its descendants, sampled.

PSS (proportional set size, `Pss:` in /proc/PID/smaps_rollup) counts each page once across the
processes that share it, so the sum over a process tree is what the run costs the machine; RSS
would count every page a fork shares once per process. Linux only; elsewhere the figures are None.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PROC = Path("/proc")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def pss_bytes(pid: int) -> int | None:
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident bytes (/proc/PID/statm): a counter the kernel keeps, read at once, where PSS
    walks the page tables. At least the PSS; counts shared pages in full."""
    try:
        return int((PROC / str(pid) / "statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def process_tree(root: int) -> dict[int, list[int]]:
    """root and every process below it: pid -> its children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = children.get(pid, [])
        todo += tree[pid]
    return tree


def descendants(root: int) -> list[int]:
    """root and every process below it."""
    return list(process_tree(root))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def give_back_freed_memory(threshold: int = 1 << 20) -> None:
    """Make glibc return freed blocks of `threshold` bytes and more to the system at once. By
    default it raises its mmap threshold each time a large block is freed (up to 32 MB), after
    which tensors of that size come from the heap, whose freed space it keeps: lowering makes
    and drops hundreds of weight copies of a few MB to 64 MB each, and a process kept its peak.
    Inherited by processes forked after the call. No-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, threshold)
        libc.mallopt(M_TRIM_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def meminfo(field: str) -> int | None:
    """A /proc/meminfo figure in bytes (MemTotal, MemAvailable, ...)."""
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_budget(max_memory_gb: float | None) -> int | None:
    """What the lowering jobs running at once may be expected to hold: max_memory_gb, else most of
    what is free now."""
    if max_memory_gb is not None:
        return int(max_memory_gb * 1e9)
    available = meminfo("MemAvailable")
    return None if available is None else int(available * 0.9)


def gb(value: int | None) -> str:
    return "?" if value is None else f"{value / 1e9:.2f} GB"


class PeakMemory:
    """Samples the summed PSS of this process's tree while in use
    (`with PeakMemory() as memory: ...; memory.peak`); also the peak of the root process alone and
    of each process it started, with that one's own children (a job and the forks it makes), so
    that the work a process did can be told its share (`peak_of(pid)`).

    Reading PSS walks a process's page tables, which takes longer the more a process maps; read
    every `interval` seconds it would take much of a core from the work measured, so PSS is read
    every 50 times what a read costs (~2% of a core: `wait_per_read_cost`). In between, every
    `interval` seconds, the tree's summed RSS (a counter, read at once) is read, and a rise of
    `rise` bytes over the RSS of the last PSS reading is read at once: a spike shorter than the
    wait between PSS readings (QNN's compile ends with one) is not missed (docs/scale.md, how the
    peak is sampled)."""

    def __init__(
        self, interval: float = 0.25, root: int | None = None, rise: int = 64 << 20, wait_per_read_cost: float = 49
    ):
        self.interval, self.root, self.rise = interval, root or os.getpid(), rise
        self.wait_per_read_cost = wait_per_read_cost
        self.peak: int | None = None
        self.per_process: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample(self, tree: dict[int, list[int]] | None = None) -> int | None:
        tree = tree or process_tree(self.root)
        own = {pid: pss for pid in tree if (pss := pss_bytes(pid)) is not None}
        if not own:
            return None

        def below(pid: int) -> int:  # a process and the processes it started (a job's own forks)
            return own.get(pid, 0) + sum(below(child) for child in tree[pid])

        started = {pid: below(pid) for pid in tree[self.root]}
        total = own.get(self.root, 0) + sum(started.values())
        with self._lock:
            for pid, pss in [(self.root, own.get(self.root, 0)), *started.items()]:
                self.per_process[pid] = max(self.per_process.get(pid, 0), pss)
            self.peak = max(self.peak or 0, total)
        return total

    def peak_of(self, pid: int) -> int | None:
        """The peak of the root process alone, or of a process below it with its own children."""
        with self._lock:
            return self.per_process.get(pid)

    def _run(self) -> None:
        due, rss_then = 0.0, 0
        while not self._stop.wait(self.interval):
            tree = process_tree(self.root)
            rss = sum(rss_bytes(pid) or 0 for pid in tree)
            if time.perf_counter() >= due or rss > rss_then + self.rise:
                started = time.perf_counter()
                self.sample(tree)
                cost = time.perf_counter() - started
                due, rss_then = time.perf_counter() + self.wait_per_read_cost * cost, rss

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="composite-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


class Stopwatch:
    """Wall seconds per named stage of a run, in the order they first ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
