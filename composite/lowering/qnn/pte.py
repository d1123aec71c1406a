"""The bytes of a lowered QNN shard: its contexts' headers and compile specs, edited in place.

ExecuTorch writes each QNN context's payload as magic (4 bytes), signature (int64), size (8
bytes), context binary. These edits change what identifies a context or how the runtime sets it
up, never the context binary itself.
"""

from __future__ import annotations

import hashlib
import struct

from composite.lowering.program import executorch_config


def qnn_backend_modules(edge) -> list:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    modules = []
    for method in edge.methods:
        for submodule in edge.exported_program(method).graph_module.modules():
            if isinstance(submodule, LoweredBackendModule) and submodule.backend_id == "QnnBackend":
                modules.append(submodule)
    return modules


CONTEXT_MAGIC = 0xABCD  # low half of 0x5678ABCD, ExecuTorch's QnnContextCustomProtocol magic number


def content_signatures(edge) -> None:
    """Each QNN context's signature made from its content. ExecuTorch's signature is the time the
    context was compiled, and the runtime uses it to find the context the methods of a program
    share (decode and prefill in one context). A hash of the rest of the payload identifies the
    context as well, and makes a shard's bytes the same wherever and whenever it is lowered (a
    local export, a cluster's, the cache's)."""
    signed: dict[bytes, bytes] = {}  # the methods of a context get one copy of it, not one each
    for module in qnn_backend_modules(edge):
        payload = module.processed_bytes
        magic, _ = struct.unpack_from("<Iq", payload)
        if magic & 0xFFFF != CONTEXT_MAGIC:
            raise RuntimeError(
                "a QNN delegate payload without ExecuTorch's context header: unknown ExecuTorch version?"
            )
        hasher = hashlib.sha256(payload[:4])
        hasher.update(memoryview(payload)[12:])
        digest = hasher.digest()
        if digest not in signed:
            signature = int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)
            signed[digest] = payload[:4] + struct.pack("<q", signature) + payload[12:]
        module._processed_bytes = signed[digest]


def context_bytes(edge) -> int:
    """The bytes of the shard's context binaries: what the HTP holds of its weights and graphs.
    One context per payload; the methods of a context share it (content_signatures made its
    signature a hash of the rest)."""
    return sum({m.processed_bytes[4:12]: len(m.processed_bytes) for m in qnn_backend_modules(edge)}.values())


def own_spill_fill(edge) -> int:
    """The spill-fill bytes the shard's own contexts need, written into their compile specs (the
    export later raises it to the size shared by all QNN shards: with_spill_fill)."""
    from executorch.backends.qualcomm.utils.utils import update_spill_fill_size

    modules = qnn_backend_modules(edge)
    return int(update_spill_fill_size(modules)) if modules else 0


def with_spill_fill(buffer: bytes, size: int) -> bytes:
    """A lowered QNN shard's .pte with `size` as every context's spill-fill buffer. On device the
    HTP backend keeps one process-wide buffer of the largest size any context asks for, shared by
    all of them. Only the compile specs change (the context binaries do not depend on it), so the
    program is rewritten by ExecuTorch's own serializer, not lowered again; a shard that already
    has `size` is returned as it is. The rewritten file is a function of the shard's bytes and
    the size alone: a shard lowered here, on another machine or taken from the cache ends up the
    same."""
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
        flatbuffer_to_option,
        option_to_flatbuffer,
    )
    from executorch.backends.qualcomm.utils.constants import QCOM_QNN_COMPILE_SPEC
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    pte = deserialize_pte_binary(buffer)
    changed = False
    for plan in pte.program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != "QnnBackend":
                continue
            for spec in delegate.compile_specs:
                if spec.key != QCOM_QNN_COMPILE_SPEC:
                    continue
                options = flatbuffer_to_option(spec.value)
                if options.backend_options.htp_options.max_sf_buf_size != size:
                    options.backend_options.htp_options.max_sf_buf_size = size
                    spec.value = option_to_flatbuffer(options)
                    changed = True
    if not changed:
        return buffer
    config = executorch_config()
    return bytes(
        serialize_pte_binary(
            pte,
            extract_delegate_segments=config.extract_delegate_segments,
            segment_alignment=config.segment_alignment,
            constant_tensor_alignment=config.constant_tensor_alignment,
            delegate_alignment=config.delegate_alignment,
        )
    )
