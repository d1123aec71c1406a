"""A cache of lowered shards, so a re-export lowers only the shards whose inputs changed.

An entry is a shard's .pte (and the .ptd of the weights it keeps outside it) and its manifest
entry, under a key that hashes everything that decides those bytes: the shard's ShardWork
(lowering/work.py, every field: its layers, placement and options, rotation, methods, the
embedding's quantization, the checkpoint tensors it is made of as the file stores them, and for a
QNN shard its calibration calls and the float model that feeds it), the versions of torch,
executorch, torchao and this package's source, and for QNN shards the QNN libraries. A QNN shard
is stored with the spill-fill size it needs itself; the export raises it to the shared size when
it writes the shard. It lives in ~/.cache/composite/shards (COMPOSITE_CACHE moves it,
COMPOSITE_CACHE=off or --no-cache turns it off), holds at most COMPOSITE_CACHE_MAX_MB megabytes
(default 20480), least recently used first out.

Entries are never trusted blindly: a hit's .pte must have its recorded size and sha256 and pass
the same program check as a fresh shard; one that does not is dropped with one line of warning
and lowered again. Entries are written in a private folder and renamed into place, and eviction
holds a lock, so exports running at once into one cache do not corrupt it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from composite import manifest_files, manifest_write, staging
from composite.errors import UserError
from composite.units import MIB

SCHEMA = 1
DEFAULT_MAX_MB = 20480
ENTRY_FILE, PTE_FILE, DATA_FILE = "entry.json", "shard.pte", "shard.ptd"  # .ptd: weights kept outside
# What a manifest entry says about its place in one export, not about the shard's bytes.
PLACE_KEYS = ("index", "file", "export_seconds", "cache")


def source_fingerprint(excluded: tuple[str, ...] = ("bench", "eval", "tune")) -> str:
    """Changes whenever this package's Python (or C) source changes: lowered bytes depend on it.
    The subpackages in `excluded` (default: those that never lower a shard) do not count."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.c")):
        if not set(excluded) & set(path.relative_to(package).parts):
            digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def tensors_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's parameters and buffers: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    seen = set()
    items = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in sorted(items, key=lambda item: item[0]):
        if name in seen:
            continue
        seen.add(name)
        data = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{data.dtype}|{list(data.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps({"schema": SCHEMA, **parts}, sort_keys=True, default=str).encode()).hexdigest()


def export_keys(works: list) -> dict[int, str]:
    """Each shard's cache key: its ShardWork's key parts (lowering/work.py: everything that decides
    the shard's .pte and manifest entry) and what the code it is lowered with is: the versions of
    the libraries and of this package's source, and for a QNN shard the QNN libraries' build."""
    known: dict[str, str] = {}  # a tensor two shards read (a tied table, the float model) is hashed once

    def digests(names: list[str]) -> dict[str, str]:
        missing = [n for n in names if n not in known]
        if missing:
            known.update(works[0].weights.digests(missing))
        return {name: known[name] for name in names}

    code = qnn_code = {"versions": manifest_write.versions(), "source": source_fingerprint()}
    if any(work.placement.backend == "qnn" for work in works):
        from composite import qnn_host

        qnn_code = {**code, "qnn_build": qnn_host.prepare().build_id}
    return {
        work.spec.index: key_of(
            {"code": qnn_code if work.placement.backend == "qnn" else code, **work.key_parts(digests)}
        )
        for work in works
    }


def hits(cache: ShardCache | None, keys: dict[int, str], folder: Path, files: dict[int, str]) -> dict[int, dict]:
    """The shards the cache has (index -> manifest entry), their files copied into `folder`."""
    entries = {}
    for index, file_name in files.items():
        hit = cache.get(keys[index], folder, file_name) if cache is not None else None
        if hit is not None:
            entries[index] = {"index": index, "file": file_name, **hit, "cache": "hit"}
    return entries


def store(cache: ShardCache | None, keys: dict[int, str], entry: dict, folder: Path) -> None:
    """A shard just lowered into `folder` kept in the cache (entry["cache"] says whether)."""
    if cache is None:
        entry["cache"] = "off"
        return
    cache.put(keys[entry["index"]], folder / entry["file"], entry)
    entry["cache"] = "stored"


class ShardCache:
    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = Path(root), max_bytes

    @classmethod
    def from_environment(cls) -> ShardCache | None:
        """The cache COMPOSITE_CACHE names (default ~/.cache/composite/shards); None for "off"."""
        root = os.environ.get("COMPOSITE_CACHE") or Path.home() / ".cache" / "composite" / "shards"
        if str(root).lower() == "off":
            return None
        limit = os.environ.get("COMPOSITE_CACHE_MAX_MB", str(DEFAULT_MAX_MB))
        try:
            max_mb = int(limit)
        except ValueError:
            max_mb = -1
        if max_mb < 0:
            raise UserError(f"COMPOSITE_CACHE_MAX_MB must be a whole number of megabytes >= 0, got {limit!r}")
        return cls(Path(root), max_mb * MIB)

    def _folder(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str, folder: Path, file_name: str) -> dict | None:
        """The cached shard for `key` copied to folder/file_name, and its manifest entry (without
        its place in an export); None on a miss. A corrupt entry is dropped, with a warning."""
        entry_dir = self._folder(key)
        if not entry_dir.is_dir():
            return None
        target = folder / file_name
        try:
            entry = json.loads((entry_dir / ENTRY_FILE).read_text())
            shutil.copyfile(entry_dir / PTE_FILE, target)
            if target.stat().st_size != entry["size"] or manifest_files.sha256_file(target) != entry["sha256"]:
                raise ValueError("its .pte does not match its recorded size and sha256")
            if "data" in entry:
                data = target.with_suffix(".ptd")
                entry["data"] = {**entry["data"], "file": data.name}
                shutil.copyfile(entry_dir / DATA_FILE, data)
                if (
                    data.stat().st_size != entry["data"]["size"]
                    or manifest_files.sha256_file(data) != entry["data"]["sha256"]
                ):
                    raise ValueError("its .ptd does not match its recorded size and sha256")
            from executorch.runtime import Runtime

            manifest_files.check_against_program(Runtime.get().load_program(target), {**entry, "index": "?"})
        except FileNotFoundError:
            target.unlink(missing_ok=True)
            target.with_suffix(".ptd").unlink(missing_ok=True)
            return None  # evicted by another export while being read
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            target.unlink(missing_ok=True)
            target.with_suffix(".ptd").unlink(missing_ok=True)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"warning: dropped a corrupt cache entry {entry_dir} ({reason}); lowering it again", file=sys.stderr)
            self._remove(entry_dir)
            return None
        os.utime(entry_dir)  # most recently used
        return entry

    def put(self, key: str, pte: Path, entry: dict) -> None:
        """Store a shard; a failure to write the cache costs the cache, never the export."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            private = staging.unfinished(Path(tempfile.mkdtemp(prefix=".new-", dir=self.root)))
            shutil.copyfile(pte, private / PTE_FILE)
            if "data" in entry:
                shutil.copyfile(pte.with_suffix(".ptd"), private / DATA_FILE)
            stored = {k: v for k, v in entry.items() if k not in PLACE_KEYS}
            (private / ENTRY_FILE).write_text(json.dumps(stored))
            target = self._folder(key)
            target.parent.mkdir(exist_ok=True)
            try:
                os.rename(private, target)
            except OSError:  # another export stored the same shard first
                shutil.rmtree(private, ignore_errors=True)
            staging.finished(private)
            self._evict()
        except OSError as e:
            print(f"warning: could not store a shard in the cache {self.root}: {e.strerror}", file=sys.stderr)

    @contextmanager
    def _lock(self):
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _entries(self) -> list[tuple[float, int, Path]]:
        entries = []
        for entry_dir in self.root.glob("??/*"):
            try:
                size = sum(f.stat().st_size for f in entry_dir.iterdir())
                entries.append((entry_dir.stat().st_mtime, size, entry_dir))
            except OSError:
                continue
        return entries

    def _evict(self) -> None:
        with self._lock():
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            for _, size, entry_dir in entries:
                if total <= self.max_bytes:
                    break
                self._remove(entry_dir)
                total -= size

    def _remove(self, entry_dir: Path) -> None:
        """Out of sight at once (a rename), then deleted."""
        try:
            doomed = Path(tempfile.mkdtemp(prefix=".old-", dir=self.root))
            os.rename(entry_dir, doomed / "entry")
            shutil.rmtree(doomed, ignore_errors=True)
        except OSError:
            shutil.rmtree(entry_dir, ignore_errors=True)
