"""Running an op on tpu tensors: the kernel of its signature, run in the eager mode of the moment.

``execute`` is what every non-view op on the device reaches (``_kernels``): it finds the op's
``Kernel`` (``_core``: signatures, kernels, automatic dynamic ints) and hands it to Fused mode's
recorder (``_fused``), to the jitted kernel (Strict, Debug), to the growing appends (``_grow``),
to a concrete run (results of data-dependent shape) or to the CPU fallback. Imports run one way:
``_storage`` <- ``_core`` <- ``_fused``, ``_grow`` <- this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import tpudist.ops as tops
from tpudist import matmul_precision as precision
from tpudist.device import _fused, _groups, _grow, _layouts, _oom, _parts
from tpudist.device import _runtime as rt
from tpudist.device import views
from tpudist.device._core import (
    _F64, _KERNELS, _STATIC_FLOAT_OPS, PRECISION, _DataDependent, _device_mismatch, _Generalised, _resolve,
    _signature, result_of,
)
from tpudist.device._debug import check_arguments, check_nans
from tpudist.device._storage import (
    X64, Lazy, Shaped, buffer_of, concrete, flush, from_cpu, is_tpu, new_tensor, stored, to_jax, to_torch, value_of,
)
from tpudist.device._storage import outputs as _outputs
from tpudist.ops import host_checks

aten = torch.ops.aten


def _grown(mode, op, args, kwargs):
    """An op at a place where a tensor grows (token ids, a KV cache, its masks: ``_grow``), or None."""
    planned = _grow.plan(op, args, kwargs)
    if planned is None:
        return None
    kernel, leaves, buffers, scalars, finish = planned
    result = _dispatch(mode, op, args, kwargs, kernel, leaves, buffers, scalars)
    return result if finish is None else finish(result)


def execute(op, args, kwargs, whole=False):
    """Run one non-view op on tpu tensors in the current eager mode.

    The hot path of every op: a cache hit goes from the signature to the recorder (Fused) or the
    jitted kernel (Strict) with no other call; anything else goes through ``_resolve``. A foreach op
    over a model's parameters runs a layer's worth at a time (``_groups``), unless ``whole``.
    """
    if kwargs and kwargs.get("generator") is not None:  # draw from the generator's stream, not the default
        return rt.run_with_generator(execute, op, args, kwargs)
    mode = rt.get_mode()
    if not whole and _groups.eligible(op) and _parts.enabled():
        grouped = _groups.run(op, args, kwargs, _whole)
        if grouped is not NotImplemented:
            return grouped
    if op in _grow.ALWAYS and rt.dynamic_scalars():
        grown = _grown(mode, op, args, kwargs)
        if grown is not None:
            return grown
    static = id(op) in _STATIC_FLOAT_OPS
    key, leaves, buffers, scalars = _signature(op, args, kwargs, static)
    # any other op runs at a capacity only if it reads a grown storage: the signature's buffers say so in
    # about a microsecond, where _grow.plan looked at every tensor of every op while anything grew (HF
    # static-cache generate, 133 ops a token: 9.9 -> 8.4 ms a token). The weak dict's own ``__len__`` is
    # Python code (~0.2 us an op); its dict is what it holds.
    if _grow.CAPACITY.data and op not in _grow.ALWAYS and _grow.reads_grown_storage(buffers) and rt.dynamic_scalars():
        grown = _grown(mode, op, args, kwargs)
        if grown is not None:
            return grown
    kernel = _KERNELS.get(key)
    if kernel is None or kernel.__class__ is _Generalised:
        try:
            kernel, leaves, buffers, scalars = _resolve(op, args, kwargs, static, key, leaves, buffers, scalars)
        except _DataDependent:
            return run_concrete(op, args, kwargs)
        except tops.UnsupportedOp as missing:
            if rt.cpu_fallback():
                _check_cpu_kernel(op, missing)
                return run_on_cpu(op, args, kwargs)
            raise
    else:
        rt.stats["hits"] += 1
    if mode.records:
        if kernel.random:
            scalars = scalars + list(rt.next_rng(args))
        return _fused.record(kernel, leaves, buffers, scalars)
    return _dispatch(mode, op, args, kwargs, kernel, leaves, buffers, scalars)


def _whole(op, args, kwargs):
    return execute(op, args, kwargs, True)


def _dispatch(mode, op, args, kwargs, kernel, leaves, buffers, scalars):
    if kernel.random:
        scalars = scalars + list(rt.next_rng(args))
    if mode.records:
        return _fused.record(kernel, leaves, buffers, scalars)
    arrays = []
    for b in buffers:
        v = b.value
        if v.__class__ is Lazy or v.__class__ is Shaped:
            arrays = [concrete(b) for b in buffers]
            break
        arrays.append(v)
    if mode.checks:
        check_arguments(op, args, kwargs)
    try:
        # jax.jit keys its programs by the matmul precision too: a new setting traces the kernel again
        prev_precision = PRECISION.swap_local(precision.jax_name(precision.current())) if kernel.matmul else None
        prev = X64.swap_local(True)  # what jax.enable_x64(True) does, without a context manager per op
        try:
            traced = host_checks.TRACED[0]
            # no scalars: no float64 vector to put on the device per call (the kernel never reads one)
            outs = kernel.jitted(arrays, np.asarray(scalars, _F64)) if scalars else kernel.jitted_plain(arrays)
            if kernel.host_checks or host_checks.TRACED[0] != traced:  # an assert: its error comes out here
                kernel.host_checks = True
                host_checks.raise_failed()
            # made from no array (zeros_like: AdamW's state) a result is not committed to the device; every
            # kernel reading it would compile again once it reads a committed one (Strict's step 2)
            if outs and not getattr(outs[0], "_committed", True):
                outs = jax.device_put(outs, rt.device())
        finally:
            X64.set_local(prev)
            if kernel.matmul:
                PRECISION.set_local(prev_precision)
        if mode.checks:
            jax.block_until_ready(outs)
    except Exception as e:
        _oom.raise_if_oom(e, f"{op}", _oom.kernel_bytes(kernel))
        raise type(e)(f"{op} failed on the tpu device: {e}") from e
    rt.stats["ops"] += 1
    num_written = kernel.num_written
    if num_written:
        for slot, value in zip(kernel.written_slots, outs):
            buffers[slot].value = value
    fresh = _outputs(kernel.outputs, outs[num_written:] if num_written else outs, None, 0, None)
    if mode.checks and rt.nan_check():
        check_nans(op, outs)
    return fresh[0] if kernel.single_result else result_of(kernel, leaves, fresh)


def run_concrete(op, args, kwargs):
    """Ops whose results are not tensors of a known shape: run on concrete arrays, no jit."""
    flush()
    leaves, treedef = tree_flatten((args, kwargs))
    vals = []
    for x in leaves:
        if is_tpu(x):
            vals.append(value_of(x))
        elif isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise _device_mismatch(op, x)
            vals.append(jnp.asarray(x.item(), tops.to_jax_dtype(x.dtype)))
        else:
            vals.append(x)
    a, k = tree_unflatten(vals, treedef)
    with jax.enable_x64(True), precision.scope(precision.current()):
        result = tops.call(op, *a, **k)
    rt.stats["concrete_ops"] += 1

    def wrap(r):
        if isinstance(r, (jax.Array, np.ndarray)):
            with jax.enable_x64(True):
                r = jax.device_put(jnp.asarray(r), rt.device())
            return new_tensor(r.shape, tops.to_torch_dtype(r.dtype), r.reshape(-1))
        return r

    out, out_def = tree_flatten(result)
    return tree_unflatten([wrap(r) for r in out], out_def)


def _check_cpu_kernel(op, missing) -> None:
    """The CPU fallback runs whatever torch's dispatcher picks for CPU tensors (a CPU kernel, else a
    composite one); an op with none (CUDA-only ops like _thnn_fused_lstm_cell) cannot fall back."""
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "CPU"):  # noqa: SLF001
        raise tops.UnsupportedOp(op, " and no CPU or composite kernel either, so the CPU fallback cannot run it",
                                 reached=missing.reached) from missing


def run_on_cpu(op, args, kwargs):
    """The CPU fallback: torch's CPU kernel on host copies, then every storage it wrote copied back.

    Each tpu storage is copied to the host once and every argument on it becomes a view of that copy
    (same sizes, strides, offset, conj/neg bits), so arguments that alias on the device alias on the
    host. A storage goes back to the device only if its bytes changed: that covers the schema's
    ``(a!)`` arguments and writes a schema does not declare, and never writes a stale copy of a read
    argument over a written one.
    """
    flush()
    rt.warn_fallback(str(op))
    leaves, treedef = tree_flatten((args, kwargs))
    mirrors: dict[int, tuple] = {}
    cpu_leaves = [_host_view(x, mirrors) if is_tpu(x) else x for x in leaves]
    a, k = tree_unflatten(cpu_leaves, treedef)
    result = op(*a, **k)
    for buf, host, before in mirrors.values():
        if _changed(host, before):
            buf.value = to_jax(host)
    by_id = {id(c): x for x, c in zip(leaves, cpu_leaves) if is_tpu(x)}
    out, out_def = tree_flatten(result)
    return tree_unflatten([by_id.get(id(r), r if not isinstance(r, torch.Tensor) else _from_host_result(r))
                           for r in out], out_def)


def _from_host_result(r: torch.Tensor) -> torch.Tensor:
    """A CPU kernel's fresh result on the device, with the strides the CPU kernel gave it."""
    strides = _layouts.copy_strides(r)
    return from_cpu(r, None if strides == views.contiguous_strides(r.shape) else strides)


def _host_view(x: torch.Tensor, mirrors: dict) -> torch.Tensor:
    """``x`` as a view of a host copy of its storage (one copy per storage, kept in ``mirrors``)."""
    buf = buffer_of(x)
    entry = mirrors.get(id(buf))
    if entry is None:
        value = concrete(buf)
        if value is None:  # unwritten: reads as zeros
            before, host = None, torch.zeros(buf.numel, dtype=buf.dtype)
        else:
            before = np.asarray(value)  # the device value: immutable, the snapshot to compare with
            host = to_torch(value).reshape(-1)
        entry = mirrors[id(buf)] = (buf, host, before)
    host = entry[1]
    host = host.view(x.dtype) if host.dtype != x.dtype else host
    view = host.as_strided(tuple(x.shape), tuple(x.stride()), x.storage_offset())
    view = view.conj() if x.is_conj() else view
    return view._neg_view() if x.is_neg() else view  # noqa: SLF001


def _changed(host: torch.Tensor, before) -> bool:
    now = host.view(torch.uint8).numpy()
    if before is None:
        return bool(now.any())
    return not np.array_equal(now, np.ascontiguousarray(before).reshape(-1).view(np.uint8))


def copy_from_cpu(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (tpu) <- src (cpu), broadcasting and casting like copy_."""
    src = src.detach().to(dst.dtype).expand(dst.shape)
    buf = buffer_of(dst)
    if dst.storage_offset() == 0 and dst.numel() == buf.numel and dst.dtype == buf.dtype:
        # dst covers its storage, row-major or in another dense order (channels_last): replace it
        order = None if dst.is_contiguous() else views.permuted_order(dst.shape, dst.stride())
        if order is not None or dst.is_contiguous():
            if isinstance(buf.value, Lazy):
                flush()
            buf.value = stored(src) if order is None else to_jax(src, order)
            return
    tmp = from_cpu(src)
    execute(aten.copy_.default, (dst, tmp), {})
