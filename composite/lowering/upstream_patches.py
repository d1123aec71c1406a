"""Changes to torch, torchao and ExecuTorch internals that lowering makes while it runs, each
undone when its context ends. Every one keeps the lowered bytes as they are and removes a cost
(time or memory) of the pinned versions; each names, in TARGETS, the upstream functions whose
behaviour it relies on, with their shape in those versions (a hash of their source, or a native
function's signature). tests/test_upstream_patches.py fails when one of them changes: the patch
must then be checked against the new code, and kept, changed or dropped.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import inspect
import os
import tempfile

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """An upstream function or class a patch relies on, as it is in the pinned version."""

    version: str  # the package and version it was read in, e.g. "torch 2.13.0"
    module: str
    name: str  # attribute path in the module, e.g. "QnnManager.Compile"
    shape: str  # sha256 of its source (first 16 hex digits), or a native function's signature

    def current_shape(self) -> str:
        obj = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
        obj = getattr(obj, "__wrapped__", obj)  # a functools.cache'd function: the function itself
        try:
            return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        except TypeError:  # a native (pybind) function: the signature its docstring starts with
            return (obj.__doc__ or "").splitlines()[0]


QNN_COMPILE = Target(
    "executorch 1.5.1",
    "executorch.backends.qualcomm.python.PyQnnManagerAdaptor",
    "QnnManager.Compile",
    "Compile(self: executorch.backends.qualcomm.python.PyQnnManagerAdaptor.QnnManager, arg0: "
    "collections.abc.Sequence[str], arg1: collections.abc.Sequence[collections.abc.Sequence["
    "executorch::backends::qnn::OpWrapper]]) -> numpy.typing.NDArray[numpy.int8]",
)

# patch -> the upstream code it replaces or relies on
TARGETS: dict[str, list[Target]] = {
    "linear_time_observers": [
        Target("torch 2.13.0", "torch.ao.quantization.fx.utils", "get_new_attr_name_with_prefix", "1b607f727ed24eca"),
        Target("torch 2.13.0", "torch.ao.quantization.fx.prepare", "_insert_obs_or_fq", "eafd3828d5466c2a"),
        Target("torchao 0.18.0", "torchao.quantization.pt2e.prepare", "_get_observer_kwargs", "6c39e236944cf3be"),
    ],
    "lean_preprocess": [
        Target(
            "executorch 1.5.1",
            "executorch.exir.backend.backend_details",
            "BackendDetails.copy_exported_program_for_preprocess",
            "161d76674b18cbbd",
        ),
        Target(
            "executorch 1.5.1",
            "executorch.backends.qualcomm.qnn_preprocess",
            "QnnBackend.preprocess_multimethod",
            "846b88b2db3fe07c",
        ),
        QNN_COMPILE,
    ],
    "forget_cached_modules": [
        Target("torch 2.13.0", "torch.ao.quantization.fx.utils", "assert_and_get_unique_device", "f1f3fea1c955317f"),
        Target("torchao 0.18.0", "torchao.utils", "_assert_and_get_unique_device", "f69054c433d2cc30"),
    ],
    "provenance_shared": [Target("torch 2.13.0", "torch.fx.traceback", "NodeSource", "0e29c3d55d6345c3")],
}

# Upstream code composite relies on without patching it: where -> what it reads. The same tripwire
# (tests/test_upstream_patches.py): a change means reading the new code before trusting ours.
RELIED_ON: dict[str, list[Target]] = {
    # LPBQ scales put on the grid QNN's builder rounds them to, through ExecuTorch's per-block
    # config, observer and builder.
    "lowering/qnn/lpbq.py, lowering/qnn/quantizer.py:on_lpbq_grid": [
        Target(
            "executorch 1.5.1",
            "executorch.backends.qualcomm.builders.node_visitor",
            "NodeVisitor.make_qnn_per_block_config",
            "1fb4e29452a28542",
        ),
        Target(
            "executorch 1.5.1",
            "executorch.backends.qualcomm.quantizer.qconfig",
            "get_ptq_per_block_quant_config",
            "08e7a0bc33901aec",
        ),
        Target(
            "executorch 1.5.1",
            "executorch.backends.qualcomm.quantizer.observers.per_block_param_observer",
            "PerBlockParamObserver",
            "ca5bcf78f7ec020b",
        ),
        Target(
            "executorch 1.5.1", "executorch.backends.qualcomm.quantizer.quantizer", "ModuleQConfig", "e211cd3fe3995ac2"
        ),
    ],
}


@contextlib.contextmanager
def linear_time_observers():
    """prepare_pt2e with two quadratic costs removed, the same graph out.

    - Each observer's attribute name is found by trying activation_post_process_0, _1, ... until
      one is free (get_new_attr_name_with_prefix, as _insert_obs_or_fq calls it): quadratic in the observers, thousands in a
      shard of a few layers. Names are handed out in order and none is removed while preparing,
      so the search goes on from the last name given.
    - Each observer's constructor arguments are deep-copied and thrown away (_get_observer_kwargs);
      ExecuTorch's QNN ConcatObserver takes the whole fx graph as an argument, so every
      concatenation copied the graph twice. The arguments are only read: a shallow copy serves."""
    # the modules (their packages export functions of the same names)
    fx_prepare = importlib.import_module("torch.ao.quantization.fx.prepare")
    pt2e_prepare = importlib.import_module("torchao.quantization.pt2e.prepare")

    next_free: dict[tuple[int, str], int] = {}

    def attr_name_with_prefix(prefix: str):
        prefix = prefix.replace(".", "_")

        def new_name(module):
            index = next_free.get((id(module), prefix), 0)
            while hasattr(module, f"{prefix}{index}"):
                index += 1
            next_free[(id(module), prefix)] = index + 1
            return f"{prefix}{index}"

        return new_name

    def observer_kwargs(quant_spec):
        return {field.name: getattr(quant_spec, field.name) for field in dataclasses.fields(quant_spec)}

    saved = fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs
    fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs = attr_name_with_prefix, observer_kwargs
    try:
        yield
    finally:
        fx_prepare.get_new_attr_name_with_prefix, pt2e_prepare._get_observer_kwargs = saved


@contextlib.contextmanager
def lean_preprocess(weights_to: str | None = None):
    """QNN's preprocess without copies of the weights it no longer reads.

    - ExecuTorch deep-copies every partition's program before a backend's preprocess
      (BackendDetails.copy_exported_program_for_preprocess, in case the backend changes it), and
      QNN's preprocess holds the copies of all methods while it compiles them into one context: a
      copy of the shard's quantized weights per method. QNN's preprocess passes rewrite the graph,
      not the tensors' data: the copy takes the graph and shares the tensors.
    - By the time QNN compiles (QnnManager.Compile), its tensor wrappers hold their own copies of
      the weights, yet the programs' tensors stay alive through the compile, its peak. With a
      folder `weights_to` (on a disk: on tmpfs it would be memory still), their data is moved just
      before it to a file there and mapped back copy-on-write: the same values for whatever reads
      them after, in memory only if it does.
    Same context binaries."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as qnn_manager
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend

    if "copy_exported_program_for_preprocess" in vars(QnnBackend):  # a QNN with a copy of its own: left to it
        yield
        return
    wrapped: list[torch.Tensor] = []  # the tensors of the programs QNN has been given

    def copy_sharing_constants(cls, program, compile_specs):
        tensors = [
            t for t in [*program.state_dict.values(), *program.constants.values()] if isinstance(t, torch.Tensor)
        ]
        wrapped.extend(tensors)
        return copy.deepcopy(program, memo={id(t): t for t in tensors})

    compile_ = qnn_manager.QnnManager.Compile

    def compile_with_weights_on_disk(manager, *args):
        if weights_to is not None:
            mapped_from_disk(wrapped, weights_to)
        wrapped.clear()
        return compile_(manager, *args)

    QnnBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_constants)
    qnn_manager.QnnManager.Compile = compile_with_weights_on_disk
    try:
        yield
    finally:
        del QnnBackend.copy_exported_program_for_preprocess
        qnn_manager.QnnManager.Compile = compile_


def mapped_from_disk(tensors: list[torch.Tensor], folder: str, smallest: int = 1 << 16) -> None:
    """Each tensor's data (of `smallest` bytes or more) written to one file in `folder` and the
    tensor made to read it from there (a private map of the file, unlinked at once): every holder
    of the tensor sees the same values, and its old storage is freed unless another tensor shares
    it. Pages are read back from the file only where something reads them."""
    tensors = [t for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.untyped_storage().nbytes() >= smallest:
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    if not storages:
        return
    offsets, size = {}, 0
    for key, storage in storages.items():
        offsets[key] = size
        size += -(-storage.nbytes() // 4096) * 4096  # page-aligned: every dtype's element offset whole
    handle, path = tempfile.mkstemp(prefix="composite-qnn-weights-", dir=folder)
    try:
        with open(handle, "wb") as file:
            for key, storage in storages.items():
                file.seek(offsets[key])
                file.write(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
            file.truncate(size)
        mapped = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).untyped_storage()
    finally:
        os.unlink(path)
    with torch.no_grad():
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key in offsets:
                first = offsets[key] // t.element_size() + t.storage_offset()
                t.set_(mapped, first, t.size(), t.stride())


def forget_cached_modules() -> None:
    """torch's and torchao's device lookups of prepare and convert are functools.cache'd on the
    module: every graph they saw, and its float weights, would stay alive until the process ends."""
    from torch.ao.quantization.fx.utils import assert_and_get_unique_device
    from torchao.utils import _assert_and_get_unique_device

    assert_and_get_unique_device.cache_clear()
    _assert_and_get_unique_device.cache_clear()


@contextlib.contextmanager
def provenance_shared():
    """Node provenance passed on by reference. Every graph pass gives each node it makes a
    NodeSource that deep-copies the whole chain of NodeSources before it, so the copying grows
    with the passes a graph has been through. Nothing in torch or ExecuTorch changes a NodeSource
    once made (they read the chain: debug handles, the inspector), so sharing the chain keeps
    every node's provenance, and the program's bytes, as they are."""
    from torch.fx.traceback import NodeSource

    own = NodeSource.__dict__.get("__deepcopy__")  # None: copy.deepcopy's default, as in torch 2.13
    NodeSource.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if own is None:
            del NodeSource.__deepcopy__
        else:
            NodeSource.__deepcopy__ = own
