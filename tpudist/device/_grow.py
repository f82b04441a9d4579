"""Growing caches on the device: appends into bucketed capacity, attention over it at a runtime length.

A decoding loop with a growing KV cache (Hugging Face's default ``DynamicCache``:
``keys = torch.cat([keys, new_keys], dim=-2)`` per layer and token) gives every token new shapes: the
``cat``, and the attention that reads the cache. Each new shape is a new kernel (Strict) and a new
fused program (Fused). Here, as for growing token ids (``_core._append_for``, a flat append), a
``cat`` seen at the same place with a second length puts its result in a storage of bucketed
*capacity* (``tpudist.device.buckets.growth()``) along the cat dim: the result is an ordinary strided
view ``(b, h, n, d)`` of a ``(b, h, capacity, d)`` storage, so every op sees its exact shape. What
changes is the cost of the two ops a decoding step runs on it:

- the next append reads the old storage whole and writes the new part at a runtime position: one
  kernel per capacity, not per length;
- ``scaled_dot_product_attention`` (one op on the device, ``_attention``) over keys and values that
  are such views reads the whole capacity and masks the positions at and past the runtime length:
  scores ``-inf``, values 0 (the storage past the length holds whatever an earlier append left). The
  softmax over ``-inf`` columns adds exact zeros, so the result equals attention over the exact length.

Any other op on such a view runs on its exact shape (one kernel per length, as before: correct, not
bounded), so does attention with a mask whose last dim is the length (padding masks of batched
generation). ``torch.tpu.cache_stats()["growing_tensors"]`` counts the sites that grew.
"""

from __future__ import annotations

import hashlib
import math
import weakref

import jax
import jax.numpy as jnp
import torch
from torch.utils._pytree import tree_flatten

from tpudist import ops as tops
from tpudist.device import _runtime as rt
from tpudist.device import buckets, views
from tpudist.device._core import Kernel, _offset
from tpudist.device._storage import _ATTR, _create_empty, buffer_of, is_tpu

aten = torch.ops.aten
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default

_FIRST_LENGTH: dict = {}  # (dtype, shape without the cat dim, dim, appended shape) -> first length seen
_GREW: set = set()
_KERNELS: dict = {}
_GROWN: weakref.WeakSet = weakref.WeakSet()  # the Buffers growing appends made (a capacity each)


def _capacity_strides(shape, d, capacity):
    sizes = list(shape)
    sizes[d] = capacity
    return views.contiguous_strides(tuple(sizes))


def capacity_of(t: torch.Tensor, d: int):
    """The capacity along ``d`` if ``t`` is a view at offset 0 of a storage a growing append made, laid
    out as ``t.shape`` with ``d`` extended to the capacity, else None."""
    if t.storage_offset() != 0:
        return None
    buf = buffer_of(t)
    if buf.dtype != t.dtype or buf not in _GROWN:
        return None
    other = math.prod(t.shape) // t.shape[d] if t.shape[d] else 0
    if other == 0 or buf.numel % other:
        return None
    capacity = buf.numel // other
    if capacity < t.shape[d]:
        return None
    want = _capacity_strides(t.shape, d, capacity)
    if any(n != 1 and s != w for n, s, w in zip(t.shape, t.stride(), want)):
        return None
    return capacity


def _kernel(key, build):
    """The kernel cached under ``key``, built on a miss (counted as the device's other kernels are)."""
    kernel = _KERNELS.get(key)
    if kernel is None:
        rt.stats["misses"] += 1
        kernel = _KERNELS[key] = build()
    else:
        rt.stats["hits"] += 1
    return kernel


def _spec(t, slot):
    sizes = tuple(t.shape)
    strides = tuple(0 if n == 1 else s for n, s in zip(sizes, t.stride()))
    return ("T", slot, sizes, strides, t.storage_offset(), t.dtype)


class _GrowingAppend(Kernel):
    """cat([a, b], d) into a storage of ``capacity`` along ``d``: ``a`` read as its old capacity storage
    (``a_capacity``, its length a runtime input) or, the first time, as a plain tensor (``a_spec``)."""

    def __init__(self, slots, a_spec, a_capacity, b_spec, outer, capacity, inner, dtype):
        op = aten.cat.default
        super().__init__(op, op, "functional", None, (b_spec,), slots, None, 1, False,
                         [((outer * capacity * inner,), dtype)], ("single", None))
        self.a_spec, self.a_capacity, self.b_spec = a_spec, a_capacity, b_spec
        self.outer, self.capacity, self.inner = outer, capacity, inner
        self.stable_id = hashlib.sha256(repr(("grow", slots, a_spec, a_capacity, b_spec, outer, capacity, inner,
                                              str(dtype))).encode()).hexdigest()[:24]

    def __repr__(self):
        return f"GrowingAppend(capacity={self.capacity})"

    def trace(self, arrays, sc, base=0, raw=False):
        flats = self.storages(arrays)
        _, b_slot, b_sizes, b_strides, b_offset, dtype = self.b_spec
        want = tops.to_jax_dtype(dtype)
        tail = views.read_as(flats[b_slot], b_sizes, b_strides, b_offset, want).reshape(self.outer, -1, self.inner)
        if self.a_capacity is not None:
            old = flats[0][:self.outer * self.a_capacity * self.inner].reshape(self.outer, self.a_capacity, self.inner)
        else:
            _, slot, sizes, strides, offset, _ = self.a_spec
            old = views.read_as(flats[slot], sizes, strides, offset, want).reshape(self.outer, -1, self.inner)
        keep = min(old.shape[1], self.capacity)
        out = old if keep == self.capacity else jnp.zeros((self.outer, self.capacity, self.inner), want)
        if out is not old:
            out = jax.lax.dynamic_update_slice(out, old[:, :keep], (0, 0, 0))
        zero = jnp.zeros((), jnp.int64)
        out = jax.lax.dynamic_update_slice(out, tail, (zero, _offset(sc[base]), zero))
        return [out.reshape(-1)]


def _strided_growth_allowed(a, d) -> bool:
    """The two growing tensors a capacity may turn strided: a KV cache ``(batch, heads, length, dim)``
    along its length, and batched token ids or attention masks ``(batch, length)`` (int or bool)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return a.dim() == 4 and d == 2
    return a.dim() == 2 and d == 1


def append_for(args, kwargs):
    """(kernel, leaves, buffers, scalars, shape, strides) of a growing append, or None (an ordinary cat).

    What ``_core._append_for`` (flat int appends) leaves: two tensors of one dtype and rank, equal but
    for the cat dim, either a flat float append (every dim before the cat dim of size 1: the result
    stays contiguous) or one of the two tensors ``_strided_growth_allowed`` names (the result is a
    strided view of the capacity; any other non-flat append stays an ordinary cat, so that no
    contiguous result turns strided where ``x.view()`` would then fail).
    """
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if len(tensors) != 2:
        return None
    a, b = tensors
    if not (is_tpu(a) and is_tpu(b)) or a.dtype != b.dtype or a.dim() == 0 or b.dim() != a.dim():
        return None
    d = dim % a.dim()
    if tuple(b.shape[:d]) != tuple(a.shape[:d]) or tuple(b.shape[d + 1:]) != tuple(a.shape[d + 1:]):
        return None
    if not all(a.shape) or not all(b.shape):
        return None
    if any(n != 1 for n in a.shape[:d]) and not _strided_growth_allowed(a, d):
        return None  # a capacity along this dim would make the result non-contiguous (x.view() could fail)
    site = (a.dtype, tuple(a.shape[:d]), tuple(a.shape[d + 1:]), d, tuple(b.shape))
    first = _FIRST_LENGTH.setdefault(site, a.shape[d])
    if first == a.shape[d]:
        return None  # not seen growing here (yet): an ordinary cat
    buf_a, buf_b = buffer_of(a), buffer_of(b)
    if buf_a.dtype != a.dtype or buf_b.dtype != b.dtype:
        return None
    a_capacity = capacity_of(a, d)
    length = a.shape[d] + b.shape[d]
    capacity = max(buckets.growth().capacity_for(length), a_capacity or 0)
    outer, inner = math.prod(a.shape[:d]), math.prod(a.shape[d + 1:])
    buffers = [buf_a] if buf_b is buf_a else [buf_a, buf_b]
    b_spec = _spec(b, buffers.index(buf_b))
    a_spec = None if a_capacity is not None else _spec(a, 0)
    slots = [(buf.numel, buf.dtype) for buf in buffers]
    key = (tuple(slots), tuple(buf.value is None for buf in buffers), a_spec, a_capacity, b_spec, capacity)
    if site not in _GREW:
        _GREW.add(site)
        rt.stats["growing_tensors"] += 1
    kernel = _kernel(key, lambda: _GrowingAppend(slots, a_spec, a_capacity, b_spec, outer, capacity, inner, a.dtype))
    shape = list(a.shape)
    shape[d] = length
    return kernel, [a, b], buffers, [a.shape[d]], tuple(shape), _capacity_strides(shape, d, capacity)


def strided_over(flat: torch.Tensor, shape, strides) -> torch.Tensor:
    """A tensor of ``shape`` and ``strides`` over ``flat``'s storage (its Buffer: the capacity)."""
    t = _create_empty(tuple(shape), flat.dtype)
    buf = buffer_of(flat)
    _GROWN.add(buf)
    setattr(t.untyped_storage(), _ATTR, buf)
    return aten.as_strided.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.Meta),  # noqa: SLF001
                                              t, tuple(shape), tuple(strides), 0)


# -- attention over a grown cache ---------------------------------------------------------------------

class _PaddedAttention(Kernel):
    """SDPA with keys and values read as their whole capacity and masked at the runtime length."""

    def __init__(self, slots, q_spec, kv_slots, capacity, is_causal, scale, out_shape, out_dtype):
        super().__init__(ATTENTION, ATTENTION, "functional", None, (q_spec,), slots, None, 1, False,
                         [(out_shape, out_dtype), (out_shape[:-1], torch.float32)],
                         ("fresh", tree_flatten((0, 0))[1]))
        self.q_spec, self.kv_slots, self.capacity = q_spec, kv_slots, capacity
        self.is_causal, self.scale = is_causal, scale
        self.stable_id = hashlib.sha256(repr(("padded-attention", slots, q_spec, kv_slots, capacity, is_causal,
                                              scale)).encode()).hexdigest()[:24]

    def __repr__(self):
        return f"PaddedAttention(capacity={self.capacity})"

    def trace(self, arrays, sc, base=0, raw=False):
        flats = self.storages(arrays)
        _, slot, sizes, strides, offset, dtype = self.q_spec
        q = views.read_as(flats[slot], sizes, strides, offset, tops.to_jax_dtype(dtype))
        (k_slot, k_shape), (v_slot, v_shape) = self.kv_slots
        k = flats[k_slot][:math.prod(k_shape)].reshape(k_shape)
        v = flats[v_slot][:math.prod(v_shape)].reshape(v_shape)
        valid = jnp.arange(self.capacity) < _offset(sc[base])
        v = jnp.where(valid[:, None], v, jnp.zeros((), v.dtype))
        mask = jnp.broadcast_to(valid, (1, 1, 1, self.capacity))
        out, lse = tops.call(ATTENTION, q, k, v, 0.0, self.is_causal, attn_mask=mask, scale=self.scale)
        return [out.astype(tops.to_jax_dtype(self.fresh[0][1])).reshape(-1), lse.astype(jnp.float32).reshape(-1)]


def attention_for(args, kwargs):
    """(kernel, leaves, buffers, scalars) of SDPA over keys/values grown into a capacity, or None."""
    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None or dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if not (is_tpu(q) and is_tpu(k) and is_tpu(v)) or k.shape[2] != v.shape[2]:
        return None
    k_capacity, v_capacity = capacity_of(k, 2), capacity_of(v, 2)
    if k_capacity is None or k_capacity != v_capacity:
        return None
    buffers = []
    for t in (q, k, v):
        buf = buffer_of(t)
        if buf not in buffers:
            buffers.append(buf)
    if buffer_of(q).dtype != q.dtype:
        return None
    q_spec = _spec(q, buffers.index(buffer_of(q)))
    k_shape = (*k.shape[:2], k_capacity, k.shape[3])
    v_shape = (*v.shape[:2], v_capacity, v.shape[3])
    kv_slots = ((buffers.index(buffer_of(k)), k_shape), (buffers.index(buffer_of(v)), v_shape))
    slots = [(buf.numel, buf.dtype) for buf in buffers]
    scale = kwargs.get("scale")
    key = ("attention", tuple(slots), tuple(buf.value is None for buf in buffers), q_spec, kv_slots, bool(is_causal),
           scale)
    kernel = _kernel(key, lambda: _PaddedAttention(slots, q_spec, kv_slots, k_capacity, bool(is_causal), scale,
                                                   tuple(q.shape), q.dtype))
    return kernel, [q, k, v], buffers, [k.shape[2]]
