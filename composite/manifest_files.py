"""The files beside a manifest (composite/manifest.py describes them): their sha256, their sizes
and presence, the bytes an export stores, and a loaded program checked against its entry."""

from __future__ import annotations

import hashlib
from pathlib import Path

from composite.errors import UserError
from composite.manifest import SCALAR_TYPE_NAMES


def stored_bytes(shards: list[dict]) -> int:
    """Bytes of an export's shard files, each data file they read counted once."""
    data = {shard["data"]["file"]: shard["data"]["size"] for shard in shards if "data" in shard}
    return sum(shard["size"] for shard in shards) + sum(data.values())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_against_program(program, shard: dict) -> None:
    """A lowered program's own method metadata must match what the manifest promises for it
    (program: an executorch.runtime Program)."""
    for method, io in shard["io"].items():
        meta = program.metadata(method)
        for kind, count, get in (
            ("inputs", meta.num_inputs(), meta.input_tensor_meta),
            ("outputs", meta.num_outputs(), meta.output_tensor_meta),
        ):
            expected = io[kind]
            if count != len(expected):
                raise RuntimeError(f"shard {shard['index']} {method}: {count} {kind}, manifest says {len(expected)}")
            for i, entry in enumerate(expected):
                info = get(i)
                dtype = SCALAR_TYPE_NAMES.get(int(info.dtype()), str(info.dtype()))
                if list(info.sizes()) != entry["shape"] or dtype != entry["dtype"]:
                    raise RuntimeError(
                        f"shard {shard['index']} {method} {kind[:-1]} {entry['name']}: program has "
                        f"{list(info.sizes())} {dtype}, manifest says {entry['shape']} {entry['dtype']}"
                    )


def check_files(folder: Path, manifest: dict, verify_sha256: bool = False) -> None:
    """Every shard file, and every data file a shard reads, exists with the recorded size (and
    hash, when asked)."""
    folder = Path(folder)
    for shard in manifest["shards"]:
        for entry in (shard, shard.get("data")):
            if entry is None:
                continue
            path = folder / entry["file"]
            if not path.is_file():
                what = "" if entry is shard else ", whose weights it reads,"
                raise UserError(f"shard {shard['index']}: {path}{what} is missing")
            size = path.stat().st_size
            if size != entry["size"]:
                raise UserError(
                    f"shard {shard['index']}: {path} is {size} bytes but the manifest says {entry['size']} "
                    "(truncated, or from another export)"
                )
            if verify_sha256 and sha256_file(path) != entry["sha256"]:
                raise UserError(
                    f"shard {shard['index']}: {path} does not match the manifest's sha256 (from another export?)"
                )
    tokenizer = manifest.get("tokenizer")
    if tokenizer and not (folder / tokenizer["file"]).is_file():
        raise UserError(f"tokenizer {folder / tokenizer['file']} named by the manifest is missing")
