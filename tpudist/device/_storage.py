"""Device storages: a Buffer on each tpu storage, host <-> device copies, values of views.

A "tpu" tensor is a real PrivateUse1 TensorImpl over an empty storage whose Python object holds a
``Buffer``: the flat ``jax.Array`` of the storage, a ``Lazy`` value a pending fused graph will
compute, a ``Shaped`` result of a compiled program, or None before anything was written (reads as
zeros). Every alias shares it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax._src import config as _jax_config

import tpudist.ops as tops
from tpudist import bridge
from tpudist._switches import shaped_storage
from tpudist.device import _fastpath, _hooks, _oom
from tpudist.device import _runtime as rt
from tpudist.device import views

_ATTR = "_tpudist_buffer"
# jax.enable_x64's state (jax 0.10): the per-op paths set it with swap_local/set_local, which is what
# ``with jax.enable_x64(True)`` does, without building a context manager per call (~2 us a call)
X64 = _jax_config.enable_x64


class Buffer:
    """What a tpu storage holds: ``value`` is a flat jax.Array, a fused ``Lazy``, a ``Shaped`` array or
    None (unwritten). Code that reads the array itself takes ``concrete(buf)``.

    ``outputs`` (C++) makes Buffers and ``Lazy`` values without calling ``__init__``: keep both
    ``__init__`` methods plain stores of their arguments."""

    __slots__ = ("value", "numel", "dtype", "__weakref__")

    def __init__(self, numel: int, dtype: torch.dtype, value=None):
        self.value, self.numel, self.dtype = value, int(numel), dtype


def buffer_of(t: torch.Tensor) -> Buffer:
    buf = getattr(t.untyped_storage(), _ATTR, None)
    if buf is None:
        raise RuntimeError("this tpu tensor has no device buffer (it was not made by tpudist.device)")
    return buf


def has_buffer(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds a device buffer (a tensor subclass wrapping tpu tensors does not)."""
    return getattr(t.untyped_storage(), _ATTR, None) is not None


def is_whole(t: torch.Tensor, buf: Buffer) -> bool:
    """Whether ``t`` is its storage's (``buf``'s) whole row-major view: the storage's array, flat or
    reshaped to ``t``'s shape, is ``t``'s values."""
    return t.is_contiguous() and t.storage_offset() == 0 and buf.numel == t.numel() and buf.dtype == t.dtype


def is_tpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu"


def new_tensor(shape, dtype: torch.dtype, value=None, numel: int | None = None, strides=None) -> torch.Tensor:
    """A tensor of ``shape`` over a new storage holding ``value``: contiguous, or of the dense ``strides``
    (then ``value`` holds the elements in that physical order: ``views.permuted_order``)."""
    shape = tuple(int(s) for s in shape)
    t = create_empty(shape, dtype, None if strides is None else tuple(int(s) for s in strides))
    attach(t, Buffer(math.prod(shape) if numel is None else numel, dtype, value))
    return t


def tensor_over(buf: Buffer, shape: tuple) -> torch.Tensor:
    """A contiguous tensor of ``shape`` (a tuple of ints) over a new storage holding ``buf``."""
    t = _create_empty(shape, buf.dtype)
    attach(t, buf)
    return t


def attach(t: torch.Tensor, buf: Buffer) -> None:
    """Make ``buf`` what the fresh storage of ``t`` holds, and the storage ``buf``'s size in bytes."""
    storage = t.untyped_storage()
    setattr(storage, _ATTR, buf)
    _hooks.set_storage_bytes(storage, buf.numel * buf.dtype.itemsize)


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """The buffer's side of ``UntypedStorage.resize_(nbytes)`` of a tpu storage (the C++ hooks call it, then set
    the storage's byte size). 0 frees the buffer's ``jax.Array`` (FSDP2 frees unsharded parameters so), another
    size keeps the leading elements and reads as zeros past them (FSDP2 writes every element of a storage it
    re-allocated before reading one)."""
    buf = getattr(storage, _ATTR, None)
    if buf is None:
        raise RuntimeError("UntypedStorage.resize_ of a tpu storage without a device buffer (it was not made by "
                           "tpudist.device)")
    itemsize = buf.dtype.itemsize
    if nbytes % itemsize:
        raise RuntimeError(f"UntypedStorage.resize_({nbytes}) of a tpu storage of {buf.dtype}: the size in bytes "
                           f"must be a multiple of the element size, {itemsize}")
    numel = nbytes // itemsize
    if numel == buf.numel:
        return
    if numel == 0 or buf.value is None:
        buf.value = None
    else:
        with jax.enable_x64(True):
            kept = concrete(buf)[:numel]
            buf.value = jnp.pad(kept, (0, numel - kept.shape[0])) if kept.shape[0] < numel else kept
    buf.numel = numel


_create_empty = torch._C._acc.create_empty_tensor  # noqa: SLF001


def _create_empty_py(shape: tuple, dtype: torch.dtype, strides: tuple | None = None) -> torch.Tensor:
    """A tensor of ``shape`` and ``strides`` (contiguous for None) over an empty PrivateUse1 storage.
    ``create_empty`` is this function in C++ (``csrc/fastpath.cpp``) where that built."""
    t = _create_empty(shape, dtype)
    if strides is None:
        return t
    # the Meta kernel restrides without a view's autograd bookkeeping: a plain tensor over t's storage
    return torch.ops.aten.as_strided.default.redispatch(_META, t, shape, strides, 0)


_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)  # noqa: SLF001


# -- host <-> device ---------------------------------------------------------------------------------


# float64 and complex128 on a TPU: the chip has no float64 unit and XLA emulates one with pairs of
# float32 (measured on a TPU v5e, JAX 0.10.2, scripts/probes/f64_in_range.py): every copy to the chip
# changes values (median 2 ulp, up to ~1e3), float32's exponent range only, -0.0 stored as 0.0
EMULATED_ON_TPU = (torch.float64, torch.complex128)
FLOAT64_ON_TPU = (
    "float64 on a TPU is emulated by XLA with pairs of float32, not IEEE float64: values beyond float32's range "
    "(|x| > 3.4e38) become inf, -0.0 becomes 0.0, a copy to the chip and back changes most values in their last "
    "bits (median 2 ulp, up to ~1e3 ulp measured on a TPU v5e) and arithmetic loses more (up to 2**40 ulp near "
    "float32's smallest normals). Keep float64 computations that must match the CPU on the CPU, or use float32 "
    "(docs/device.md, Limits). This warning is shown once per process.")
_warned_float64 = [False]


def _on_tpu() -> bool:
    """Whether the device's arrays live on a TPU (tests patch this to check the TPU-only paths)."""
    return rt.device().platform == "tpu"


def warn_if_emulated(dtype: torch.dtype) -> None:
    """Warn, once per process, when a float64 or complex128 value is first put on (or made on) a TPU."""
    if _warned_float64[0] or dtype not in EMULATED_ON_TPU or not _on_tpu():
        return
    _warned_float64[0] = True
    warnings.warn(FLOAT64_ON_TPU, UserWarning, stacklevel=3)


def to_jax(t: torch.Tensor, order=None, shaped: bool = False):
    """A CPU tensor's values as a flat jax.Array on the device (a copy: torch keeps its memory), in
    row-major order of ``t.permute(order)`` where ``order`` is given (a storage's physical order);
    of the tensor's own shape where ``shaped``."""
    t = t.detach()
    t = t.permute(order) if order is not None else t
    t = t.clone() if t.is_contiguous() else t.contiguous()
    if t.dtype == torch.bfloat16:
        host = t.view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        host = t.numpy()
    dev = rt.device()
    warn_if_emulated(t.dtype)
    try:
        with jax.enable_x64(True):  # else int64/float64 are silently truncated to 32 bits
            return jax.device_put(host if shaped else host.reshape(-1), dev)
    except jax.errors.JaxRuntimeError as e:
        _oom.raise_if_oom(e, f"copying a {tuple(t.shape)} {t.dtype} tensor to the device", host.nbytes)
        raise


def stored(t: torch.Tensor):
    """A CPU tensor's values as a row-major storage of its own holds them on the device (a copy): flat, or
    in the tensor's shape (``Shaped``) where it has more than one dimension and ``TPUDIST_SHAPED_STORAGE`` is on."""
    if t.dim() > 1 and shaped_storage():
        return Shaped(to_jax(t, shaped=True))
    return to_jax(t)


def to_torch(array) -> torch.Tensor:
    """A row-major CPU tensor of its own with a device value's values (``tpudist.bridge.host_copy``); a
    program it waited for that ran out of chip memory raises the device's out-of-memory error."""
    try:
        return bridge.host_copy(array)
    except jax.errors.JaxRuntimeError as e:
        _oom.raise_if_oom(e, "reading a tpu tensor to the host", array.nbytes)
        raise


_READERS: dict = {}


def value_of(t: torch.Tensor, for_host: bool = False):
    """The concrete jax.Array value of a tpu tensor (flushes a pending fused graph first); ``for_host``: its
    elements as a 1-D array where the shape does not matter (a copy to the host, reshaped there)."""
    buf = buffer_of(t)
    sizes, strides, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    shaped = buf.value
    if (shaped.__class__ is Shaped and shaped.array.shape == sizes and offset == 0 and buf.dtype == t.dtype
            and views.is_contiguous(sizes, strides)):
        return shaped.array  # the whole of a compiled program's result, as it came
    # XLA:TPU fails to compile a program whose result is an N-d complex128 array (a RET_CHECK in its
    # float64 emulation, on a layout; a 1-D one compiles: scripts/probes/c128_reader.py), so a complex128
    # read for the host comes out flat there
    flat_out = for_host and t.dtype == torch.complex128 and _on_tpu()
    flat = concrete(buf)
    want = tops.to_jax_dtype(t.dtype)
    if flat is None or 0 in sizes:
        with jax.enable_x64(True):  # an int64 or complex128 value keeps its dtype
            return jnp.zeros(sizes, want)
    # The offset is an argument of the reader, not part of its key: reading a view that moves along its
    # storage (a decode loop's ids[:, -1], a cache slot) reuses one program.
    # The device too: a reader from the program cache is an executable of this device, and a new
    # world (a new JAX backend) has new devices.
    key = (sizes, strides, flat.shape, flat.dtype, t.dtype, rt.device(), flat_out)
    reader = _READERS.get(key)
    if reader is None:
        rt.stats["readers"] += 1
        reader = _READERS[key] = _reader(key, flat, offset)
    try:
        with jax.enable_x64(True):
            return reader(flat, np.int64(offset))
    except jax.errors.JaxRuntimeError as e:
        _oom.raise_if_oom(e, f"reading a {sizes} {t.dtype} view of a tpu tensor", math.prod(sizes) * t.dtype.itemsize)
        raise


def _reader(key: tuple, flat, offset: int):
    """The program that reads a view of ``key``'s layout out of a flat storage array: its XLA
    executable from tpudist's program cache where any rank or host compiled it (JAX's cache, on
    multi-process CPU, is written by process 0 only), else compiled and stored; jitted as it is
    without a cache root."""
    from tpudist.runtime import program_cache

    sizes, strides, _, _, dtype, device, flat_out = key
    want = tops.to_jax_dtype(dtype)

    def read(f, start):
        value = views.read_at(f, sizes, strides, start, want)
        return value.reshape(-1) if flat_out else value

    if program_cache.default_cache() is None:
        return jax.jit(read)
    parts = (_source_fingerprint(), sizes, strides, flat.shape, str(flat.dtype), str(dtype), flat_out)
    with jax.enable_x64(True):
        compiled, _, _ = program_cache.load_or_compile("reader", parts, jax.jit(read), (flat, np.int64(offset)),
                                                       [device])
    return compiled


@functools.cache
def _source_fingerprint() -> str:
    """A hash of tpudist.ops and tpudist.device sources: editing a lowering invalidates disk programs."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.joinpath("ops").rglob("*.py"), *root.joinpath("device").rglob("*.py")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _retype(value, want):
    if value.dtype == want:
        return value
    if np.dtype(value.dtype).itemsize == np.dtype(want).itemsize:
        return jax.lax.bitcast_convert_type(value, want)
    raise NotImplementedError(f"a view of dtype {want} over a storage of dtype {value.dtype} (different "
                              "item sizes) is not supported on the tpu device; use .to(dtype) instead")


def to_cpu(t: torch.Tensor, strides: tuple | None = None) -> torch.Tensor:
    """A CPU copy of the tpu tensor ``t``: contiguous, or of the dense ``strides`` (the storage read in
    their physical order, so a channels_last copy costs no transpose on the host)."""
    if strides is None or strides == views.contiguous_strides(t.shape):
        return to_torch(value_of(t, for_host=True)).reshape(t.shape)
    order = views.permuted_order(t.shape, strides)
    if order is None:
        raise AssertionError(f"strides={strides} of a {tuple(t.shape)} tensor are not a dense layout")
    flat = to_torch(value_of(t.permute(order), for_host=True)).reshape(-1)
    return torch.empty((0,), dtype=flat.dtype).set_(flat.untyped_storage(), 0, tuple(t.shape), strides)


def from_cpu(t: torch.Tensor, strides: tuple | None = None) -> torch.Tensor:
    """A device copy of the CPU tensor ``t``: contiguous, or of the dense ``strides``."""
    if strides is None:
        return new_tensor(tuple(t.shape), t.dtype, stored(t))
    order = views.permuted_order(t.shape, strides)
    if order is None:
        raise AssertionError(f"strides={strides} of a {tuple(t.shape)} tensor are not a dense layout")
    return new_tensor(tuple(t.shape), t.dtype, to_jax(t, order), strides=strides)


class Lazy:
    """A storage value that a pending fused graph will compute."""

    __slots__ = ("graph", "index")

    def __init__(self, graph, index):
        self.graph, self.index = graph, index


class Shaped:
    """A storage value a compiled program made in its result's own shape (``array``, row-major): the
    activations a compiled forward saves for its backward. They stay so, and the backward takes them as
    they are: on a TPU a flat array and an N-d one have different tiled layouts, so each reshape
    between them is a copy of the whole tensor (the f32 logits: 1 GB written, then read back). The
    device's own programs read storages flat: ``concrete`` flattens a Shaped value there, once."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


def concrete(buf: Buffer):
    """``buf``'s value as the device's programs read storages: a flat jax.Array, or None (unwritten).
    Runs a pending fused graph; flattens a ``Shaped`` value in place."""
    value = buf.value
    if value.__class__ is Lazy:
        flush()
        value = buf.value
    if value.__class__ is Shaped:
        value = buf.value = value.array.reshape(-1)
        rt.stats["shaped_flattened"] += 1
    return value


_run_pending = None  # Fused mode's flush, registered by _fused (on_flush): None until it is imported


def on_flush(run) -> None:
    """``run()`` runs the pending fused graph: ``_fused`` registers its ``flush`` when it is imported (it
    imports this module; this one never imports it). Before that no op was recorded: nothing is pending."""
    global _run_pending
    _run_pending = run


def flush() -> None:
    """Run the pending fused graph, if any (a sync point)."""
    if _run_pending is not None:
        _run_pending()


def _outputs_py(outputs, values, graph, index, written):
    """An op's fresh tensors: one per (shape, dtype, numel[, strides]) of ``outputs`` (contiguous
    without strides), over a new storage holding
    ``Buffer(numel, dtype, value)``; ``value`` is ``values[i]`` (Strict: the kernel's arrays) or, with
    ``values`` None, ``Lazy(graph, index + i)`` (Fused), whose buffer is then added to ``written``
    (weakly). ``outputs`` is this function in C++ (``csrc/fastpath.cpp``) where that built."""
    fresh = []
    for i, (shape, dtype, numel, *strides) in enumerate(outputs):
        b = Buffer(numel, dtype, Lazy(graph, index + i) if values is None else values[i])
        t = create_empty(shape, dtype, *strides)
        attach(t, b)
        fresh.append(t)
        if values is None:
            written.append(_weakref(b))
    return fresh


_weakref = weakref.ref
_fast = _fastpath.load()  # the C++ hot path (tpudist/device/_fastpath.py), or None
outputs, create_empty = _outputs_py, _create_empty_py
if _fast is not None:
    _fast.init_outputs(Buffer, Lazy, _create_empty, _ATTR)
    outputs, create_empty = _fast.outputs, _fast.create_empty


def connect_hooks() -> None:
    """After the C++ hooks were installed: fresh storages get their size in bytes (in the C++ ``outputs`` too),
    and ``UntypedStorage.resize_`` of a tpu storage reaches ``resize_storage``."""
    _hooks.on_resize(resize_storage)
    if _fast is not None:
        _fast.init_outputs(Buffer, Lazy, _create_empty, _ATTR, _hooks.storage_bytes_address())
