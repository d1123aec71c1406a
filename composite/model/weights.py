"""A checkpoint's tensors, read when asked for, a few at a time.

An export needs one shard's weights at once, never the whole model: each source here knows every
tensor's name (Meta's names) and shape from the file's header alone, reads a group of tensors as
float32 when asked, and hashes a tensor's bytes as the file stores them (the shard cache's keys).
Reads go through short-lived handles, so pages of a memory-mapped file stay mapped only while
their group is read: a mapped page counts in a process's PSS, and a 3B checkpoint is 6 GB.

q/k rows of Meta and GGUF files are reordered from interleaved rotary pairs to rotate-half as they
are read (`permuted`: name -> heads).
"""

from __future__ import annotations

import hashlib
import pickle
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from composite.errors import UserError


def meta_to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from Meta's interleaved rotary pairs to the rotate-half layout."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class WeightSource(ABC):
    """name -> shape of every tensor; read(names) -> float32 tensors; digests(names) -> sha256."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], where: str):
        self.shapes = shapes
        self.where = where  # how errors name the checkpoint
        self.permuted: dict[str, int] = {}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """float32 copies of `names`, q/k rows in rotate-half order."""
        names = list(names)
        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise KeyError(missing[0])
        tensors = self._read(names)
        for name, heads in self.permuted.items():
            if name in tensors:
                tensors[name] = meta_to_rotate_half(tensors[name], heads)
        return tensors

    def detached(self, names: Iterable[str]) -> TensorWeights:
        """`names` held in memory, as stored where the format allows (bf16 stays bf16; GGUF's are
        dequantized), with the same q/k reordering: what a worker without the checkpoint's file
        (a cluster's) reads the same float32 tensors from."""
        stored = self._stored(list(names))
        detached = TensorWeights(stored, self.where)
        detached.permuted = {name: heads for name, heads in self.permuted.items() if name in stored}
        return detached

    def _stored(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self._read(names)

    def digests(self, names: Iterable[str]) -> dict[str, str]:
        """sha256 of each tensor's stored bytes, with its name, layout and stored type."""
        return {name: digest.hexdigest() for name, digest in self._hash(list(names)).items()}

    @abstractmethod
    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The stored tensors of `names` as float32 (before any reordering)."""

    def _hash(self, names: list[str]) -> dict[str, hashlib._Hash]:
        """A sha256 per name, started by _start() and fed the tensor's stored bytes."""
        hashes = {}
        for name, tensor in self._each(names):
            hashes[name] = self._start(name, str(tensor.dtype))
            hashes[name].update(_tensor_bytes(tensor))
        return hashes

    def _each(self, names: list[str]):
        """(name, stored tensor), one at a time where the source can."""
        yield from self._stored(names).items()

    def _start(self, name: str, stored: str) -> hashlib._Hash:
        return hashlib.sha256(f"{name}|{stored}|{list(self.shapes[name])}|{self.permuted.get(name)}|".encode())


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a view, not a copy: sha256 reads the buffer where it lies (the 3B's
    table is 788 MB in bf16, which a copy would hold twice while it is hashed)."""
    data = tensor.detach().contiguous().cpu()
    return memoryview(data.view(torch.uint8).numpy()) if data.numel() else memoryview(b"")


class TensorWeights(WeightSource):
    """Tensors already in memory (the embedded default, tests)."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str = "the model"):
        super().__init__({name: tuple(t.shape) for name, t in tensors.items()}, where)
        self.tensors = tensors

    def _read(self, names):
        return {name: self.tensors[name].detach().to(torch.float32).clone() for name in names}

    def _stored(self, names):
        return {name: self.tensors[name] for name in names}


class SafetensorsWeights(WeightSource):
    """Hugging Face safetensors files; `located`: Meta name -> (file, the file's tensor name)."""

    def __init__(self, located: dict[str, tuple[Path, str]], shapes: dict[str, tuple[int, ...]], where: str):
        super().__init__(shapes, where)
        self.located = located

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        groups: dict[Path, list[str]] = {}
        for name in names:
            groups.setdefault(self.located[name][0], []).append(name)
        return groups

    def _each(self, names: list[str]):
        from safetensors import SafetensorError, safe_open

        for path, group in self._by_file(names).items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in group:
                        yield name, f.get_tensor(self.located[name][1])
            except (SafetensorError, OSError) as e:
                raise UserError(f"{path} is corrupt or unreadable: {e}") from None

    def _read(self, names):
        return {name: tensor.to(torch.float32) for name, tensor in self._each(names)}

    def _stored(self, names):
        return dict(self._each(names))


class TorchFileWeights(WeightSource):
    """A PyTorch checkpoint (Meta's consolidated.00.pth, llama2.c's stories*.pt), memory-mapped
    anew for each group so that its pages are let go once the group is copied out."""

    def __init__(self, path: Path, keys: dict[str, str], shapes: dict[str, tuple[int, ...]]):
        super().__init__(shapes, str(path))
        self.path, self.keys = path, keys  # Meta name -> key in the file's state dict

    def _each(self, names: list[str]):
        weights = state_dict_of(load_torch_file(self.path))
        for name in names:
            yield name, weights[self.keys[name]]

    def _read(self, names):
        return {name: tensor.to(torch.float32).clone() for name, tensor in self._each(names)}

    def _stored(self, names):
        return {name: tensor.clone() for name, tensor in self._each(names)}


def load_torch_file(path: Path) -> dict:
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except PermissionError:
        raise UserError(f"checkpoint {path} is not readable (permission denied)") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} is corrupt or not a PyTorch checkpoint: {first_line}") from None
    if not isinstance(data, dict):
        raise UserError(f"checkpoint {path} does not hold a state dict")
    return data


def state_dict_of(data: dict) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch checkpoint: llama2.c's wrap them under "model" and compiled models
    prefix their names with "_orig_mod."."""
    weights = data["model"] if isinstance(data.get("model"), dict) else data
    return {k.removeprefix("_orig_mod."): v for k, v in weights.items() if isinstance(v, torch.Tensor)}


class GgufWeights(WeightSource):
    """A GGUF file's tensors, each dequantized to float32 by the gguf package when read, with
    plain file reads at the offsets its header gives (no memory map outlives a read)."""

    def __init__(self, path: Path, located: dict[str, tuple], shapes: dict[str, tuple[int, ...]]):
        """located: Meta name -> (data offset, bytes, the stored array's numpy dtype and shape,
        GGML type), as the gguf package's reader describes each tensor."""
        super().__init__(shapes, str(path))
        self.path, self.located = path, located

    def _raw(self, f, name: str) -> np.ndarray:
        offset, size, dtype, shape, _ = self.located[name]
        f.seek(offset)
        return np.frombuffer(f.read(size), dtype=dtype).reshape(shape)

    def _read(self, names):
        from gguf.quants import dequantize

        tensors = {}
        with open(self.path, "rb") as f:
            for name in names:
                values = np.asarray(dequantize(self._raw(f, name), self.located[name][4]), dtype=np.float32)
                tensors[name] = torch.from_numpy(values.copy()).reshape(self.shapes[name])
        return tensors

    def _hash(self, names):
        hashes = {}
        with open(self.path, "rb") as f:
            for name in names:
                hashes[name] = self._start(name, self.located[name][4].name)
                hashes[name].update(memoryview(self._raw(f, name)))
        return hashes
