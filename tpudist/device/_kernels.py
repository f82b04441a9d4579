"""The PrivateUse1 registrations: views through Meta, memory and copy ops by hand, the rest generic.

Every op that has a lowering in ``tpudist.ops`` (and its in-place and ``out=`` twins), of any
namespace, gets our kernel directly: structured ops do not detour through ``.out`` and a
``torch.library.custom_op`` runs its lowering, not its Python body. Lowerings registered after the
install (``tpudist.kernels``) are registered as they arrive; anything else reaches the same kernel
through the PrivateUse1 fallback.

Three registrations make module semantics match CUDA's: ``native_batch_norm`` runs as its correctly
declared twins and SyncBatchNorm's ``batch_norm_gather_stats_with_counts`` writes the running
statistics (both schemas hide that update), and ``_has_compatible_shallow_copy_type``
counts tpu tensors as dense, so ``module.to("tpu")`` moves parameters in place (tied weights stay tied).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

import tpudist.ops as tops
from tpudist.device import _core as core
from tpudist.device import _execute, _hooks, _layouts
from tpudist.device import _runtime as rt
from tpudist.device import views
from tpudist.device._storage import has_buffer

aten = torch.ops.aten
_LIBS: list = []


@functools.lru_cache(maxsize=None)
def is_view_op(op) -> bool:
    schema = op._schema  # noqa: SLF001
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return any(r.alias_info is not None for r in schema.returns)


def view_kernel(op, *args, **kwargs):
    # the handle's redispatch: OpOverload.redispatch is one more Python frame per view. No lock: torch's
    # Meta kernel makes a TensorImpl over the same storage and touches no device state
    return op._handle.redispatch_boxed(core.META, *args, **kwargs)  # noqa: SLF001


def as_strided_kernel(op, base, size, stride, storage_offset=None):
    """``as_strided`` with torch's bounds check, which its Meta kernel skips for a storage without host
    data: a view past the storage's end read clamped elements, not an error."""
    offset = base.storage_offset() if storage_offset is None else storage_offset
    last = offset  # the last element's position (a plain loop: every view op ends here, ~0.5 us in all)
    for n, s in zip(size, stride):
        if n == 0:
            break
        last += (n - 1) * s
    else:
        itemsize, have = base.element_size(), base.untyped_storage().nbytes()
        # without the C++ hooks (TPUDIST_CPP_HOOKS=0) a tpu storage reports 0 bytes whatever it holds
        if (last + 1) * itemsize > have and (have or _hooks.active()):
            raise RuntimeError(
                f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize "
                f"{itemsize} requiring a storage size of {(last + 1) * itemsize} are out of bounds for storage "
                f"of size {have}")
    return op._handle.redispatch_boxed(core.META, base, size, stride, storage_offset)  # noqa: SLF001


def execute_kernel(op, *args, **kwargs):
    """The kernel of an op known to be neither special nor a view (every lowered aten op)."""
    with rt.LOCK:
        return _execute.execute(op, args, kwargs)


def generic_kernel(op, *args, **kwargs):
    # looked up by id: OpOverload.__hash__ is a Python method, and this runs for every fallback op
    special = _SPECIAL_BY_ID.get(id(op))
    if special is not None:
        with rt.LOCK:
            return special(*args, **kwargs)
    view = _IS_VIEW.get(id(op))
    if view is None:
        view = _IS_VIEW[id(op)] = is_view_op(op)
    if view:
        return view_kernel(op, *args, **kwargs)
    with rt.LOCK:
        return _execute.execute(op, args, kwargs)


# -- memory, copies, scalars -------------------------------------------------------------------------


def _dtype(dtype):
    return dtype if dtype is not None else torch.get_default_dtype()


def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    size = tuple(size)
    if memory_format is None or memory_format == torch.contiguous_format:
        return core.new_tensor(size, _dtype(dtype))
    # torch's strides for the format, and torch's error for a format that does not fit the rank
    return core.new_tensor(size, _dtype(dtype), strides=_layouts.format_strides(size, memory_format))


def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    size, stride = tuple(size), tuple(stride)
    if stride == views.contiguous_strides(size):
        return core.new_tensor(size, _dtype(dtype))
    if views.permuted_order(size, stride) is not None:  # dense (channels_last, a transposed layout)
        return core.new_tensor(size, _dtype(dtype), strides=stride)
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    base = core.new_tensor((extent,), _dtype(dtype))
    return aten.as_strided.default.redispatch(core.META, base, size, stride, 0)


def copy_(dst, src, non_blocking=False):
    if core.is_tpu(dst):
        if core.is_tpu(src):
            return _execute.execute(aten.copy_.default, (dst, src), {})
        _execute.copy_from_cpu(dst, src)
        return dst
    # dst on the host, src on the device; torch's storages hold unconjugated values, as ours do
    host = core.to_cpu(src)
    host = host.conj_physical() if src.is_conj() else host
    dst.copy_(host.neg() if src.is_neg() else host)
    return dst


def to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    """``x.to(device, dtype, memory_format=...)``: the result's strides follow torch's ``_to_copy``
    (``preserve_format`` keeps a dense tensor's strides; ``_layouts.copy_strides``)."""
    target = torch.device(device) if device is not None else x.device
    if target.type == "tpu":
        if core.is_tpu(x):  # the meta kernel gives the strides
            kwargs = {"dtype": dtype} if memory_format is None else {"dtype": dtype, "memory_format": memory_format}
            return _execute.execute(aten._to_copy.default, (x,), kwargs)
        strides = _layouts.copy_strides(x, memory_format)
        src = x if dtype is None else x.to(dtype)
        return core.from_cpu(src, None if strides == views.contiguous_strides(x.shape) else strides)
    host = core.to_cpu(x, _layouts.copy_strides(x, memory_format))
    return host.to(device=target, dtype=dtype if dtype is not None else host.dtype)


def local_scalar_dense(x):
    return core.to_cpu(x).item()


def equal(a, b):
    """``torch.equal``: a Python bool, so a sync point like ``item()`` (CUDA syncs too). Values compare
    after type promotion, as on the CPU (``torch.equal(int_t, float_t)`` can be True); NaN is unequal."""
    if a.shape != b.shape:
        return False
    return bool((a == b).all().item())


def native_multi_head_attention(*args, **kwargs):
    """MultiheadAttention's eval fast path. With ``need_weights=False`` the CPU kernel returns an undefined
    tensor, None in Python (``out, w = mha(x, x, x, need_weights=False)`` gives w None); the lowering
    returns the (0,) placeholder of torch's meta kernel, which must not reach the user."""
    out, weights = _execute.execute(aten._native_multi_head_attention.default, args, kwargs)
    need_weights = args[10] if len(args) > 10 else kwargs.get("need_weights", True)
    return out, weights if need_weights else None


def fused_sdp_choice(*args, **kwargs):
    return int(torch.nn.attention.SDPBackend.MATH)  # SDPA's math path: decomposes into lowered ops


def resize_(x, size, *, memory_format=None):
    """Resize in place, keeping the leading elements (torch's semantics), through ``.data =``.

    torch's resize_ kernels grow the storage through an allocator a Python backend cannot provide;
    swapping the TensorImpl's storage and geometry (``set_data``, no dispatch) does the same here.
    """
    size = tuple(int(n) for n in size)
    if size == tuple(x.shape):
        return x
    numel = math.prod(size)
    buf = core.buffer_of(x)
    if x.is_contiguous() and x.storage_offset() + numel <= buf.numel:
        x.data = aten.as_strided.default.redispatch(core.META, x, size, views.contiguous_strides(size),
                                                    x.storage_offset())
        return x
    fresh = core.new_tensor(size, x.dtype)
    if buf.value is not None and x.numel() and numel:
        old = core.value_of(x).reshape(-1)[:numel]
        with jax.enable_x64(True):
            core.buffer_of(fresh).value = jnp.concatenate([old, jnp.zeros((numel - old.shape[0],), old.dtype)])
    x.data = fresh
    return x


def set_source_tensor(x, source):
    x.data = source  # the storage and geometry of source (set_data: no dispatch, no allocator)
    return x


_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # noqa: SLF001


def set_source_storage(x, source):
    """``x.set_(storage)``: the whole storage as a flat tensor of ``x``'s dtype."""
    return aten.set_.source_Storage_storage_offset(x, source, 0, (source.nbytes() // x.element_size(),), ())


def set_source_storage_offset(x, source, storage_offset, size, stride=()):
    """``x.set_(storage, offset, size, stride)``: ``x`` takes the storage and that geometry (how
    ``UntypedStorage.copy_`` reads and writes a tpu storage, as bytes, and how DCP stages one).

    torch's CPU kernel (``set_storage_cpu_``) does exactly that for a tensor of any device: its checks (the
    storage's device is ``x``'s), the storage, the geometry, and an allocation only for a storage too small,
    which the bounds check here refuses first (a tpu storage grows through ``UntypedStorage.resize_``)."""
    size = tuple(size)
    stride = tuple(stride) if len(stride) else views.contiguous_strides(size)
    if source.device.type == "tpu":
        if not hasattr(source, core._ATTR):  # noqa: SLF001
            raise RuntimeError("Tensor.set_ of a tpu storage without a device buffer (it was not made by "
                               "tpudist.device)")
        need = (storage_offset + views.extent(size, stride)) * x.element_size() if all(size) else 0
        if need > source.nbytes():
            raise RuntimeError(
                f"Tensor.set_: size={size}, stride={stride}, storage_offset={storage_offset} of "
                f"{x.dtype} needs {need} bytes of its storage, which holds {source.nbytes()}"
                + ("" if source.nbytes() else " (tpu storages have their sizes with tpudist's C++ hooks only: "
                   "see the warning at import)"))
    return aten.set_.source_Storage_storage_offset.redispatch(_CPU, x, source, storage_offset, size, stride)


def record_stream(x, stream):
    return None


def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` as its correctly declared twins (torch's own rule for functionalization,
    ``native_batch_norm_decomposition`` in torch/_decomp/decompositions.py, torch 2.13).

    Its schema (``Tensor? running_mean``, no ``(a!)``) hides that training updates the running
    statistics in place, so a kernel that trusts schemas drops the update. ``_native_batch_norm_legit``
    declares them written (``Tensor(a!) running_mean``), and the generic mutating path writes them back.
    """
    if running_mean is None and running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if running_mean is None or running_var is None:
        raise RuntimeError(f"native_batch_norm: running_mean and running_var must both be tensors or both "
                           f"None, got running_mean={_kind(running_mean)}, running_var={_kind(running_var)}; "
                           "pass both (track_running_stats=True) or neither")
    if training:
        return aten._native_batch_norm_legit.default(input, weight, bias, running_mean, running_var, training,
                                                     momentum, eps)
    return aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var,
                                                             momentum, eps)


def native_batch_norm_out(input, weight, bias, running_mean, running_var, training, momentum, eps, *, out,
                          save_mean, save_invstd):
    results = native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    for dst, src in zip((out, save_mean, save_invstd), results):
        if tuple(dst.shape) != tuple(src.shape):
            resize_(dst, src.shape)
        copy_(dst, src)
    return out, save_mean, save_invstd


def batch_norm_gather_stats_with_counts(input, mean_all, invstd_all, running_mean, running_var, momentum, eps,
                                        counts):
    """SyncBatchNorm's combination of every rank's statistics, with the running-statistics update that
    CUDA's kernel makes in place and the schema (``Tensor? running_mean``, no ``(a!)``) does not declare:
    the global (mean, invstd) from the lowering, then CUDA's update with the unbiased variance of the
    union of the ranks' batches."""
    op = aten.batch_norm_gather_stats_with_counts.default
    mean, invstd = _execute.execute(op, (input, mean_all, invstd_all, running_mean, running_var, momentum, eps,
                                         counts), {})
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                total = counts.sum()
                unbiased = (invstd.pow(-2) - eps) * total / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return mean, invstd


def _kind(x):
    return "None" if x is None else f"Tensor{tuple(x.shape)}"


def _inplace_view(inplace_op, view_op):
    """An in-place view op (``transpose_``, ``squeeze_``, ``as_strided_`` ...) as ``set_data`` with the
    geometry of its out-of-place twin: torch's C++ kernels restride through ``setStorage``, which checks
    the bytes of the storage (empty here: the values live in the storage's ``jax.Array``).

    A tensor subclass wrapping tpu tensors (AOTAutograd's FunctionalTensor replays a metadata
    mutation on its wrapper, whose device is tpu) holds no device buffer and cannot take ``set_data``
    of a plain tensor: its sizes and strides change through the Meta kernel, as on any device."""
    def kernel(x, *args, **kwargs):
        if not has_buffer(x):
            return inplace_op.redispatch(core.META, x, *args, **kwargs)
        x.data = view_op.redispatch(core.META, x, *args, **kwargs)
        return x
    return kernel


def _cpu_indices_allowed(op):
    """``op`` with the CPU index tensors that CUDA accepts for a device tensor moved to the device:
    ``x[cpu_index]``, ``x[cpu_index] = v`` and their backward (HF BEiT builds its relative-position
    index on the CPU at every forward). Any other CPU tensor argument is still a device mismatch."""
    def kernel(x, indices, *args, **kwargs):
        if x.device.type == "tpu":
            indices = [i.to(x.device) if i is not None and i.device.type == "cpu" else i for i in indices]
        return _execute.execute(op, (x, indices, *args), kwargs)
    return kernel


_SPECIAL = {
    **{op: _cpu_indices_allowed(op) for op in (
        aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
        aten._unsafe_index.Tensor, aten._unsafe_index_put.default)},
    aten.empty.memory_format: empty,
    aten.empty_strided.default: empty_strided,
    aten.copy_.default: copy_,
    aten._to_copy.default: to_copy,
    aten._local_scalar_dense.default: local_scalar_dense,
    aten.equal.default: equal,
    aten._fused_sdp_choice.default: fused_sdp_choice,
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten.resize_.default: resize_,
    aten.set_.source_Tensor: set_source_tensor,
    aten.set_.source_Storage: set_source_storage,
    aten.set_.source_Storage_storage_offset: set_source_storage_offset,
    aten.record_stream.default: record_stream,
    aten.native_batch_norm.default: native_batch_norm,
    aten.native_batch_norm.out: native_batch_norm_out,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    **{inplace: _inplace_view(inplace, view) for inplace, view in (
        (aten.as_strided_.default, aten.as_strided.default), (aten.transpose_.default, aten.transpose.int),
        (aten.t_.default, aten.t.default), (aten.squeeze_.default, aten.squeeze.default),
        (aten.squeeze_.dim, aten.squeeze.dim), (aten.squeeze_.dims, aten.squeeze.dims),
        (aten.unsqueeze_.default, aten.unsqueeze.default))},
}

_SPECIAL_BY_ID = {id(op): fn for op, fn in _SPECIAL.items()}
_IS_VIEW: dict = {}

# View ops with no composite kernel (the others, detach/expand/transpose..., run torch's C++ composite,
# which ends in as_strided). Tensors made by C++ have no Python object yet: Parameter() needs that.
_VIEW_OPS = (
    aten.view.default, aten._reshape_alias.default, aten.as_strided.default, aten.unfold.default,
    aten.view_as_real.default,
)


def _twins(op) -> list:
    """The in-place and out= overloads whose functional twin is ``op``."""
    namespace, name = op._schema.name.split("::")  # noqa: SLF001
    found = []
    for packet_name in (name + "_", name):
        packet = getattr(getattr(torch.ops, namespace), packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            if candidate is not op and candidate._schema.is_mutable and tops.functional_of(candidate) == op:  # noqa: SLF001
                found.append(candidate)
    return found


_DONE: set = set()


def _impl(op, fn) -> None:
    name = op.name()
    if name in _DONE:
        return
    _DONE.add(name)
    namespace, rest = name.split("::")
    lib = _LIBS_BY_NAMESPACE.get(namespace)
    if lib is None:
        lib = _LIBS_BY_NAMESPACE[namespace] = torch.library.Library(namespace, "IMPL")
    lib.impl(rest, fn, "PrivateUse1", with_keyset=False)


_LIBS_BY_NAMESPACE: dict = {}


def _composite_implicit(op) -> bool:
    """An op with a CompositeImplicitAutograd kernel (upsample_bilinear2d.vec ...) decomposes above
    autograd into ops the device runs; a PrivateUse1 kernel for it would replace its autograd kernel
    on tpu tensors by the not-implemented fallback (no gradient). Its lowering still serves compile.
    Not so an op that also has a CPU kernel behind its own autograd kernel (silu_backward,
    mish_backward): the CPU runs that kernel, so the device runs the lowering, not the bf16 decomposition."""
    name = op.name()
    return (torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")  # noqa: SLF001
            and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"))  # noqa: SLF001


# Ops whose schema returns a fresh tensor but whose own kernel (CompositeExplicitAutograd, the one
# every device without its own runs) only makes a new TensorImpl over the input's storage, with no
# dispatch: ``_unsafe_view`` (how matmul and autograd formulas reshape a result they just made). As a
# device kernel it was one recorded op (a copy) of ~12 us host time per call, 25 per Llama step.
_METADATA_ONLY = (aten._unsafe_view.default,)


def _placed(op):
    """The kernel of an op with a tensor argument and ``device=`` (``new_*``, ``*_like``).

    Another device than tpu makes the result there, as CUDA's kernels do: ``x.new_empty(n, device="cpu")``
    is a CPU tensor (DCP's async_save stages tensors so); the op then runs on a CPU stand-in of ``x``
    (its dtype; its geometry for a ``*_like``, whose values never depend on x's). A ``*_like`` result has
    the strides torch's Meta kernel gives it: ``memory_format=torch.preserve_format`` keeps a transposed
    or otherwise permuted input's, a ``memory_format`` asks for its own."""
    like = op._schema.name.endswith("_like")  # noqa: SLF001

    def kernel(x, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and device.type != "tpu":
            host = (torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype) if like
                    else torch.empty((0,), dtype=x.dtype))
            return op(host, *args, **kwargs)
        with rt.LOCK:
            out = _execute.execute(op, (x, *args), kwargs)
            if like and (not x.is_contiguous() or kwargs.get("memory_format") not in (None, torch.preserve_format)):
                out = _strided_like(op, x, out, args, kwargs)
        return out

    return kernel


def _strided_like(op, x, out, args, kwargs):
    """``out`` (contiguous) laid out with the strides torch gives ``op``'s result for an input of ``x``'s."""
    want = op(core._meta_of(x), *args, **{**kwargs, "device": torch.device("meta")}).stride()  # noqa: SLF001
    if want == out.stride():
        return out
    strided = empty_strided(tuple(out.shape), want, dtype=out.dtype)
    if op not in (aten.empty_like.default, aten.zeros_like.default):  # an unwritten storage reads as zeros
        copy_(strided, out)
    return strided


def register_lowered(op) -> None:
    """Route ``op`` (and its in-place/out twins) on tpu tensors to its lowering in ``tpudist.ops``.

    Ops of any namespace: a ``torch.library.custom_op`` has a CompositeExplicitAutograd kernel that
    would otherwise run its Python body on tpu tensors instead of the JAX lowering.
    """
    if op in _SPECIAL or is_view_op(op) or _composite_implicit(op) or op in _METADATA_ONLY:
        return
    schema = op._schema  # noqa: SLF001
    placed = (any(a.name == "device" for a in schema.arguments)
              and any(isinstance(a.type, torch.TensorType) for a in schema.arguments))
    _impl(op, _placed(op) if placed else functools.partial(execute_kernel, op))
    for twin in _twins(op):
        if twin not in _SPECIAL:
            _impl(twin, functools.partial(execute_kernel, twin))


# -- module conversion: tpu tensors are dense tensors, as CUDA's are --------------------------------

_CPU_DENSE = torch.empty(0)


def has_compatible_shallow_copy_type(self, from_):
    """torch's rule for ``param.data = new`` (``set_data``) and ``Module._apply``'s in-place moves.

    C++ (c10/core/TensorImpl.h, ``has_compatible_shallow_copy_type``, torch 2.13) allows it between
    dense tensors of a fixed list of backends (CPU, CUDA, MPS, HIP, XPU, HPU, MTIA) that lacks
    PrivateUse1. Without this, ``module.to("tpu")`` wraps a new Parameter per referencing module
    (tied embedding/LM-head weights come apart, optimizers built earlier hold stale parameters) and
    ``cpu_param.data = tpu_tensor`` raises. Registered at AutogradPrivateUse1, which a call with a tpu
    argument dispatches to, including the check inside C++'s ``set_data``. A tpu tensor counts as a
    dense one; the other argument is dense if torch says so against a CPU tensor.
    """
    return _is_dense(self) and _is_dense(from_)


def _is_dense(x) -> bool:
    if x.layout != torch.strided:
        return False
    return x.device.type == "tpu" or torch._has_compatible_shallow_copy_type(x, _CPU_DENSE)  # noqa: SLF001


def _register_shallow_copy_rule() -> None:
    lib = torch.library.Library("aten", "IMPL")
    _LIBS.append(lib)
    lib.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type, "AutogradPrivateUse1",
             with_keyset=False)


def register() -> None:
    """Install the PrivateUse1 kernels (once, from ``tpudist.device``'s import)."""
    from tpudist.ops import registry

    _register_shallow_copy_rule()
    fallback_lib = torch.library.Library("_", "IMPL")
    _LIBS.append(fallback_lib)
    for op in _SPECIAL:
        _impl(op, functools.partial(generic_kernel, op))
    for op in _VIEW_OPS:
        _impl(op, functools.partial(as_strided_kernel if op is aten.as_strided.default else view_kernel, op))
    for op in tops.lowered_ops():
        register_lowered(op)
    registry.on_register(register_lowered)  # lowerings registered later (custom kernels) reach the device too
    fallback_lib.fallback(generic_kernel, "PrivateUse1")
