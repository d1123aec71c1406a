"""The shards' data files (.ptd, ExecuTorch's named data) merged into the one they share.

Each lowering job writes the weights its program keeps outside its .pte beside it (shard_NN.ptd);
the export then merges them into shared_table.DATA_FILE, where ExecuTorch's named-data store keeps
equal bytes once: the tied table the first and the last shard both read. Tensors are streamed
from the shards' files into the merged one, never held whole (a 3B-shaped table is 394 MB)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from executorch.exir._serialize._cord import FileBackedData
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir._serialize.data_serializer import DataPayload
from executorch.extension.flat_tensor.serialize.serialize import (
    FlatTensorHeader,
    FlatTensorSerializer,
    _deserialize_to_flat_tensor,
)

from composite.lowering.shared_table import DATA_FILE


class FileSlice(FileBackedData):
    """`size` bytes of a file from `offset`, read only when hashed or written (ExecuTorch's Cord
    writes a FileBackedData by streaming it)."""

    def __init__(self, path: Path, offset: int, size: int):
        super().__init__(str(path))
        self._offset, self._size = offset, size

    def _chunks(self, limit: int | None = None):
        left = self._size if limit is None else min(limit, self._size)
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            while left > 0:
                chunk = f.read(min(self._COPY_CHUNK_SIZE, left))
                if not chunk:
                    raise RuntimeError(f"{self._path} ends before its data does")
                left -= len(chunk)
                yield chunk

    def prefix(self, size: int) -> bytes:
        return b"".join(self._chunks(size))

    def sha256(self) -> bytes:
        if self._sha256 is None:
            digest = hashlib.sha256()
            for chunk in self._chunks():
                digest.update(chunk)
            self._sha256 = digest.digest()
        return self._sha256

    def to_bytes(self) -> bytes:
        return b"".join(self._chunks())

    def write_to_file(self, outfile) -> None:
        for chunk in self._chunks():
            outfile.write(chunk)


def named_data(path: Path) -> dict:
    """key -> (its bytes as a slice of the .ptd at `path`, its tensor layout)."""
    with open(path, "rb") as f:
        header = FlatTensorHeader.from_bytes(f.read(8 + FlatTensorHeader.EXPECTED_LENGTH)[8:])
        if not header.is_valid():
            raise RuntimeError(f"{path} is not an ExecuTorch data file")
        f.seek(0)
        table = _deserialize_to_flat_tensor(f.read(header.flatbuffer_offset + header.flatbuffer_size))
    slices = [FileSlice(path, header.segment_base_offset + s.offset, s.size) for s in table.segments]
    return {entry.key: (slices[entry.segment_index], entry.tensor_layout) for entry in table.named_data}


def merge(folder: Path, files: list[str]) -> tuple[int, int]:
    """`files` (in `folder`) merged into folder/DATA_FILE, equal bytes once, and removed.
    -> (bytes of the merged file, bytes the separate files held together)."""
    store = NamedDataStore()
    separate = 0
    for name in files:
        separate += (folder / name).stat().st_size
        for key, (data, layout) in named_data(folder / name).items():
            store.add_named_data(key, data, 1, tensor_layout=layout)
    merged = store.get_named_data_store_output()
    target, partial = folder / DATA_FILE, folder / (DATA_FILE + ".partial")
    with open(partial, "wb") as f:
        FlatTensorSerializer().serialize(DataPayload(merged.buffers, merged.pte_data)).write_to_file(f)
    partial.rename(target)
    for name in files:
        (folder / name).unlink()
    return target.stat().st_size, separate
