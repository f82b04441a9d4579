"""Growing caches on the device: appends into bucketed capacity, attention over it at a runtime length.

A decoding loop with a growing KV cache (Hugging Face's default ``DynamicCache``:
``keys = torch.cat([keys, new_keys], dim=-2)`` per layer and token) gives every token new shapes: the
``cat``, and the attention that reads the cache. Each new shape is a new kernel (Strict) and a new
fused program (Fused). Here, for token ids (a flat append) as for KV caches, a
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

The masks of batched generation and beam search's cache reorder run at the capacity too
(``padded_for``): ``arange(n)`` whose ``n`` changes at one call site makes a grown result; pointwise
ops, ``_to_copy``, ``index``, ``index_select`` and ``sum`` over inputs grown along one common length
read them whole (positions past the length read as 0) and give grown results; attention takes a
mask grown along the keys. Any other op on such a view runs on its exact shape (one kernel per
length: correct, not bounded) and is counted in ``cache_stats()["grown_exact_ops"]``;
``cache_stats()["growing_tensors"]`` counts the cat sites that grew.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import sys

import jax
import jax.numpy as jnp
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpudist import ops as tops
from tpudist.device import _runtime as rt
from tpudist.device import buckets, views
from tpudist.device._core import CAPACITY, Kernel, _cast, _offset, flatten_args, kernel_for, unflatten_args
from tpudist.device._storage import _create_empty, attach, buffer_of, is_tpu

aten = torch.ops.aten
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
ALWAYS = (aten.cat.default, ATTENTION, aten.arange.default)  # ops that may start growth (else: only on grown inputs)

_FIRST_LENGTH: dict = {}  # (dtype, shape without the cat dim, dim, appended shape) -> first length seen
# The lengths of a site's latest results (its keys and values, every layer's): a strided append grows
# only onto one of them (a sequence continued, as a cache or its beam-reordered copy), so fresh tensors
# of new lengths (a training batch: cat([tokens, eos])) stay ordinary cats with CPU's contiguous results
_RESULT_LENGTHS: dict = {}
_RESULT_LENGTHS_KEPT = 4
_GREW: set = set()
_KERNELS: dict = {}


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
    if buf.dtype != t.dtype or buf not in CAPACITY:
        return None
    # dims of stride 0 are an expand's (transformers 5.17's repeat_kv expands the cache's heads before
    # its reshape): the storage holds one copy of them
    stored = [1 if s == 0 and i != d else n for i, (n, s) in enumerate(zip(t.shape, t.stride()))]
    other = math.prod(stored) // stored[d] if stored[d] else 0
    if other == 0 or buf.numel % other:
        return None
    capacity = buf.numel // other
    if capacity < t.shape[d]:
        return None
    want = _capacity_strides(stored, d, capacity)
    if any(n != 1 and s != 0 and s != w for n, s, w in zip(t.shape, t.stride(), want)):
        return None
    return capacity


def _cached(table, key, build):
    """What ``table`` holds under ``key`` (a kernel, a plan), built on a miss and counted as the device's
    other kernels are; None, and nothing kept, where ``build`` finds the op cannot run at the capacity."""
    found = table.get(key)
    if found is None:
        found = build()
        if found is None:
            return None
        rt.stats["misses"] += 1
        table[key] = found
    else:
        rt.stats["hits"] += 1
    return found


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
    lengths = _RESULT_LENGTHS.setdefault(site, [])
    continued = a.shape[d] in lengths
    if a.shape[d] + b.shape[d] not in lengths:
        lengths.append(a.shape[d] + b.shape[d])
        del lengths[:-_RESULT_LENGTHS_KEPT]
    if first == a.shape[d]:
        return None  # not seen growing here (yet): an ordinary cat
    buf_a, buf_b = buffer_of(a), buffer_of(b)
    a_capacity = capacity_of(a, d)
    if a_capacity is None and not continued and any(n != 1 for n in a.shape[:d]):
        return None  # a strided result, and a is not the last result continued: an ordinary cat
    if buf_a.dtype != a.dtype or buf_b.dtype != b.dtype:
        return None
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
    kernel = _cached(_KERNELS, key,
                     lambda: _GrowingAppend(slots, a_spec, a_capacity, b_spec, outer, capacity, inner, a.dtype))
    shape = list(a.shape)
    shape[d] = length
    strides = _capacity_strides(shape, d, capacity)
    return kernel, [a, b], buffers, [a.shape[d]], lambda flat: strided_over(flat, shape, strides, capacity)


def strided_over(flat: torch.Tensor, shape, strides, capacity: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``strides`` over ``flat``'s storage (its Buffer: ``capacity`` along the
    grown dim)."""
    t = _create_empty(tuple(shape), flat.dtype)
    buf = buffer_of(flat)
    CAPACITY[buf] = capacity
    attach(t, buf)
    return aten.as_strided.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.Meta),  # noqa: SLF001
                                              t, tuple(shape), tuple(strides), 0)


# -- attention over a grown cache ---------------------------------------------------------------------

class _PaddedAttention(Kernel):
    """SDPA with keys and values read as their whole capacity and masked at the runtime length (and by
    the caller's mask, grown along the keys too, read at its capacity)."""

    def __init__(self, slots, q_spec, kv_slots, mask_spec, capacity, is_causal, scale, out_shape, out_dtype):
        super().__init__(ATTENTION, ATTENTION, "functional", None, (q_spec,), slots, None, 1, False,
                         [(out_shape, out_dtype), (out_shape[:-1], torch.float32)],
                         ("fresh", tree_flatten((0, 0))[1]))
        self.q_spec, self.kv_slots, self.mask_spec, self.capacity = q_spec, kv_slots, mask_spec, capacity
        self.is_causal, self.scale = is_causal, scale
        # its scores and output are dots: torch's float32 matmul precision picks the program (a kernel
        # built by _core learns this from its trace, ``Kernel.check``; on a TPU, DEFAULT is one bf16 pass)
        self.matmul = True
        self.stable_id = hashlib.sha256(repr(("padded-attention", slots, q_spec, kv_slots, mask_spec, capacity,
                                              is_causal, scale)).encode()).hexdigest()[:24]

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
        if self.mask_spec is not None:
            _, slot, sizes, strides, dtype, _ = self.mask_spec
            given = _to_capacity(views.read_as(flats[slot], sizes, strides, 0, tops.to_jax_dtype(dtype)), 3,
                                 self.capacity)
            if given.dtype == jnp.bool_:
                mask = mask & given
            else:  # an additive float mask: -inf past the length
                mask = jnp.where(mask, given, jnp.asarray(-jnp.inf, given.dtype))
        out, lse = tops.call(ATTENTION, q, k, v, 0.0, self.is_causal, attn_mask=mask, scale=self.scale)
        return [out.astype(tops.to_jax_dtype(self.fresh[0][1])).reshape(-1), lse.astype(jnp.float32).reshape(-1)]


def attention_for(args, kwargs):
    """(kernel, leaves, buffers, scalars, finish) of SDPA over keys/values grown into a capacity, or None.

    A mask must be grown along its last dim too (a padding mask built from the grown attention mask),
    or absent; a mask of the exact key length that is not grown keys the kernel per length: exact then.
    """
    q, k, v = args[:3]
    mask = kwargs.get("attn_mask")
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if not (is_tpu(q) and is_tpu(k) and is_tpu(v)) or k.shape[2] != v.shape[2]:
        return None
    k_capacity, v_capacity = capacity_of(k, 2), capacity_of(v, 2)
    if k_capacity is None or k_capacity != v_capacity:
        return None
    mask_grown = None
    if mask is not None:
        mask_grown = grown_dim(mask) if is_tpu(mask) and mask.dim() == 4 else None
        if mask_grown is None or mask_grown[0] != 3 or mask.shape[3] != k.shape[2]:
            return None
    buffers = []
    for t in (q, k, v) if mask is None else (q, k, v, mask):
        buf = buffer_of(t)
        if buf not in buffers:
            buffers.append(buf)
    if buffer_of(q).dtype != q.dtype:
        return None
    q_spec = _spec(q, buffers.index(buffer_of(q)))
    k_shape = (*k.shape[:2], k_capacity, k.shape[3])
    v_shape = (*v.shape[:2], v_capacity, v.shape[3])
    kv_slots = ((buffers.index(buffer_of(k)), k_shape), (buffers.index(buffer_of(v)), v_shape))
    mask_spec = None
    if mask is not None:
        sizes = (*mask.shape[:3], mask_grown[1])
        strides = tuple(0 if n == 1 else s for n, s in zip(sizes, mask.stride()))
        mask_spec = ("G", buffers.index(buffer_of(mask)), sizes, strides, mask.dtype, 3)
    slots = [(buf.numel, buf.dtype) for buf in buffers]
    scale = kwargs.get("scale")
    key = ("attention", tuple(slots), tuple(buf.value is None for buf in buffers), q_spec, kv_slots, mask_spec,
           bool(is_causal), scale)
    kernel = _cached(_KERNELS, key, lambda: _PaddedAttention(slots, q_spec, kv_slots, mask_spec, k_capacity,
                                                             bool(is_causal), scale, tuple(q.shape), q.dtype))
    leaves = [q, k, v] if mask is None else [q, k, v, mask]
    return kernel, leaves, buffers, [k.shape[2]], None


def plan(op, args, kwargs):
    """(kernel, leaves, buffers, scalars, finish) of an op that reads or makes a grown tensor, or None:
    a growing append, attention over a grown cache, another op at the capacity. ``finish`` (or None)
    turns the kernel's result into the op's: exact-shaped views of the capacity."""
    if op is aten.cat.default:
        return append_for(args, kwargs)
    if op is ATTENTION:
        planned = attention_for(args, kwargs)
    elif op in _NEW_FACTORIES:
        planned = _new_factory_for(op, args, kwargs)
    elif op is aten.constant_pad_nd.default:
        planned = _padded_to_width_for(args, kwargs)
    elif pads(op):
        planned = padded_for(op, args, kwargs)
    else:
        planned = None
    if planned is None and CAPACITY and _reads_grown(args, kwargs):
        rt.stats["grown_exact_ops"] += 1
    return planned


_NEW_FACTORIES = (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)


def _new_factory_for(op, args, kwargs):
    """``mask.new_ones((b, 1))`` of a grown ``mask`` (HF extends its attention mask so): the result takes
    only the dtype and device of ``self``, so a one-element view of it stands in (no shape per length)."""
    self = args[0]
    if not is_tpu(self) or grown_dim(self) is None:
        return None
    kernel, leaves, buffers, scalars = kernel_for(op, (self.as_strided((1,), (1,), 0), *args[1:]), kwargs)
    return kernel, leaves, buffers, scalars, None


def reads_grown_storage(buffers) -> bool:
    """Whether any of an op's storages (its signature's ``buffers``) is grown: else ``plan`` has nothing
    to do for it (save a ``cat``, attention or ``arange``, which may start growth)."""
    for b in buffers:
        if b in CAPACITY:
            return True
    return False


def _reads_grown(args, kwargs) -> bool:
    for x in flatten_args(args, kwargs)[0]:
        if isinstance(x, torch.Tensor) and is_tpu(x) and grown_dim(x) is not None:
            return True
    return False

# -- other ops over grown tensors: computed at the capacity, results grown too ------------------------

_PADDED_OPS = (aten._to_copy.default, aten.clone.default, aten.index.Tensor, aten.index_select.default,
               aten.sum.default, aten.sum.dim_IntList, aten.arange.default)
_MASKS_ITS_INPUTS = (aten.sum.default, aten.sum.dim_IntList)  # reduce over the grown dim: padding reads 0
_ARANGE_FIRST: dict = {}  # (dtype, layout) -> the first end ``torch.arange(end)`` saw
_ARANGE_GROWN: set = set()  # the sites of those that grew
_PLANS: dict = {}  # kernel key -> (kernel, which outputs are grown along which dim)
# the names of what the process learned about its growing tensors, and their kernels: emptied by
# torch.tpu.clear_kernel_cache (read by name: a test may put fresh ones in their place)
LEARNED = ("_KERNELS", "_FIRST_LENGTH", "_RESULT_LENGTHS", "_GREW", "_ARANGE_FIRST", "_ARANGE_GROWN", "_PLANS")


def pads(op) -> bool:
    """Whether ``op`` may run at the capacity of its grown inputs (pointwise ops and the few above: none
    of them mixes positions along the grown dim, except ``sum``, which reads padding as 0)."""
    allowed = _ALLOWED.get(op)
    if allowed is None:
        allowed = _ALLOWED[op] = op in _PADDED_OPS or (
            torch.Tag.pointwise in op.tags and not op._schema.is_mutable  # noqa: SLF001
            and torch.Tag.nondeterministic_seeded not in op.tags)
    return allowed


_ALLOWED: dict = {}


def grown_dim(t):
    """(dim, capacity) of a view that spans a grown storage at its exact length along ``dim``, or None."""
    if t.storage_offset() != 0:
        return None
    buf = buffer_of(t)
    capacity = CAPACITY.get(buf)
    if capacity is None or buf.dtype != t.dtype:
        return None
    found = [d for d in range(t.dim()) if t.shape[d] > 1 and capacity_of(t, d) == capacity]
    return (found[0], capacity) if len(found) == 1 else None


class _PaddedOp(Kernel):
    """An op whose grown inputs are read at their whole capacity (padding zeroed past the runtime length)."""

    def __init__(self, op, treedef, specs, slots, num_scalars, capacity, fresh, returns, fill=0):
        super().__init__(op, op, "functional", treedef, specs, slots, None, num_scalars, False, fresh, returns)
        self.capacity = capacity
        self.fill = fill  # what the positions past the runtime length read as
        self.stable_id = hashlib.sha256(repr(("padded", str(op), treedef, specs, slots, capacity, fill))
                                        .encode()).hexdigest()[:24]

    def __repr__(self):
        return f"PaddedOp({self.op}, capacity={self.capacity})"

    def trace(self, arrays, sc, base=0, raw=False):
        flats = self.storages(arrays)
        length = _offset(sc[base])
        leaves = []
        for spec in self.leaf_specs:
            if spec[0] == "G":
                _, slot, sizes, strides, dtype, d = spec
                x = views.read_as(flats[slot], sizes, strides, 0, tops.to_jax_dtype(dtype))
                x = _to_capacity(x, d, self.capacity)
                valid = (jnp.arange(self.capacity) < length).reshape([-1 if i == d else 1 for i in range(x.ndim)])
                leaves.append(jnp.where(valid, x, jnp.asarray(self.fill, x.dtype)))
            elif spec[0] == "V":
                _, slot, sizes, strides, index, dtype = spec
                leaves.append(views.read_at(flats[slot], sizes, strides, _offset(sc[base + index]),
                                            tops.to_jax_dtype(dtype)))
            else:
                leaves.append(spec[1])
        args, kwargs = unflatten_args(leaves, self.treedef)
        flat = tree_flatten(tops.call(self.op, *args, **kwargs))[0]
        return [_cast(r, shape, dtype).reshape(-1) for r, (shape, dtype) in zip(flat, self.fresh)]


def _grown_spec(x, slot, d, capacity):
    """The leaf spec of grown ``x`` read at its whole ``capacity`` along ``d`` (``_PaddedOp.trace``)."""
    sizes = list(x.shape)
    sizes[d] = capacity
    strides = tuple(0 if n == 1 else s for n, s in zip(sizes, x.stride()))
    return ("G", slot, tuple(sizes), strides, x.dtype, d)


def _checks(kernel, slots, num_scalars) -> bool:
    """Whether ``kernel`` traces at these storage sizes (a lowering may reject the capacity's shapes:
    the op then runs exact)."""
    with jax.enable_x64(True):
        sc = jax.ShapeDtypeStruct((num_scalars,), jnp.float64)
        arrays = [jax.ShapeDtypeStruct((n,), tops.to_jax_dtype(dt)) for n, dt in slots]
        try:
            kernel.check(arrays, sc)
        except Exception:  # noqa: BLE001 - any rejection means: not at the capacity
            return False
    return True


def _padded_to_width_for(args, kwargs):
    """``constant_pad_nd`` of a grown tensor along its grown dim, on the right, to a width that stays
    while the length grows (transformers 5.17's ``prepare_padding_mask`` pads the 2-D attention mask
    to the static cache's length every token): one kernel per width and capacity, the length a
    runtime input. The input is read at its capacity with the positions past the length set to the
    pad value, then cut or padded to the width: torch's result, whose shape is the same every token."""
    x, pad = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if not is_tpu(x) or len(pad) % 2 or value is None:
        return None
    grown = grown_dim(x)
    if grown is None:
        return None
    d, capacity = grown
    at = x.dim() - 1 - d  # pad lists (left, right) pairs from the last dim backwards
    if any(p for i, p in enumerate(pad) if i != 2 * at + 1) or 2 * at + 1 >= len(pad):
        return None  # padding on another dim, or on the left: positions move, the exact op runs
    length = x.shape[d]
    width = length + pad[2 * at + 1]
    if width < 1 or length >= capacity:
        return None
    buf = buffer_of(x)  # its dtype is x's: grown_dim checked
    at_capacity = list(pad)
    at_capacity[2 * at + 1] = width - capacity  # negative: torch's constant_pad_nd cuts
    leaves, treedef = flatten_args((x, list(at_capacity), value), {})
    specs = (_grown_spec(x, 0, d, capacity), *(("S", leaf) for leaf in leaves[1:]))
    slots = [(buf.numel, buf.dtype)]
    out = list(x.shape)
    out[d] = width

    def build():
        kernel = _PaddedOp(aten.constant_pad_nd.default, treedef, specs, slots, 1, capacity,
                           [(tuple(out), x.dtype)], ("single", None), fill=value)
        return kernel if _checks(kernel, slots, 1) else None

    kernel = _cached(_KERNELS, ("padded_to_width", specs, tuple(slots), buf.value is None, capacity), build)
    return None if kernel is None else (kernel, [x], [buf], [length], None)


def _to_capacity(x, d, capacity):
    """``x`` cut or zero-padded to ``capacity`` along ``d`` (grown storages of one length may differ in
    capacity: a cache that moved to a larger one, a mask that did not yet)."""
    have = x.shape[d]
    if have > capacity:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=d)
    if have < capacity:
        return jnp.pad(x, [(0, capacity - have if i == d else 0) for i in range(x.ndim)])
    return x


def _meta(x, sizes=None):
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape) if sizes is None else sizes, dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("meta")
    return x


def padded_for(op, args, kwargs):
    """(kernel, leaves, buffers, scalars, finish) of ``op`` run at the capacity of its grown inputs, or None.

    ``finish`` turns the op's capacity-shaped results into views of their exact shapes. The op runs
    so when every tensor it reads is either grown along a dim of one common length or has no dim of
    that length, and the results differ from the exact ones only along that dim.
    """
    leaves, treedef = flatten_args(args, kwargs)
    if op is aten.arange.default:
        return _arange_for(op, leaves, treedef)
    found = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if not is_tpu(x):
                return None
            grown = grown_dim(x)
            if grown is not None:
                found.append((i, *grown))
    if not found:
        return None
    # the longest grown length is the one padded (a grown batch index next to a grown key index is read
    # as it is: its own length is not the one that changes here)
    length = max(leaves[i].shape[d] for i, d, _ in found)
    found = [(i, d, c) for i, d, c in found if leaves[i].shape[d] == length]
    capacity = max(c for _, _, c in found)
    if any(length in x.shape for i, x in enumerate(leaves)
           if isinstance(x, torch.Tensor) and i not in {j for j, _, _ in found}):
        return None  # a tensor of the exact length that is not grown: its shape would key the kernel per length
    return _plan(op, leaves, treedef, {i: (d, c) for i, d, c in found}, length, capacity)


def _arange_for(op, leaves, treedef):
    """``torch.arange(n)`` whose ``n`` changes at the same place (a mask's key positions): grown along 0."""
    end = leaves[0]
    if type(end) is not int or end < 2 or not CAPACITY:
        return None  # only while something grows (decoding): a training step's arange(seq_len) stays exact
    site = (treedef, tuple(leaves[1:]), _caller())
    if _ARANGE_FIRST.setdefault(site, end) == end:
        return None
    if site not in _ARANGE_GROWN:
        # the first growth here: grown buffers may be garbage of a finished generation (a cycle not yet
        # collected), which must not grow a training step's arange; one collection per site tells
        gc.collect()
        if not CAPACITY:
            return None
        _ARANGE_GROWN.add(site)
    capacity = buckets.growth().capacity_for(end)
    return _plan(op, [capacity, *leaves[1:]], treedef, {}, end, capacity, exact_leaves=leaves)


def _caller():
    """(file, line) of the first caller outside torch and tpudist: which ``torch.arange`` this is (HF
    builds its batch index and its key index with two calls of one function)."""
    frame = sys._getframe(2)  # noqa: SLF001
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, tops)) + (
    os.path.dirname(os.path.dirname(__file__)) + os.sep,)


def _plan(op, leaves, treedef, grown, length, capacity, exact_leaves=None):
    buffers, slot_of, specs, scalars = [], {}, [], [length]
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            # a number's class with it: ("S", True) == ("S", 1) == ("S", 1.0), whose results' dtypes differ
            specs.append(("S", torch.device("meta")) if isinstance(x, torch.device) else
                         ("S", tuple(x)) if isinstance(x, list) else ("S", x, x.__class__))
            continue
        buf = buffer_of(x)
        if buf.dtype != x.dtype:
            return None
        slot = slot_of.get(id(buf))
        if slot is None:
            slot = slot_of[id(buf)] = len(buffers)
            buffers.append(buf)
        if i in grown:
            specs.append(_grown_spec(x, slot, *grown[i]))
        else:  # at a runtime offset (beam search's beam_idx is a column of a new tensor per step)
            _, _, sizes, strides, offset, dtype = _spec(x, slot)
            specs.append(("V", slot, sizes, strides, len(scalars), dtype))
            scalars.append(offset)
    slots = [(buf.numel, buf.dtype) for buf in buffers]
    key = ("padded", id(op), treedef, tuple(specs), tuple(slots), tuple(b.value is None for b in buffers), capacity)
    plan = _cached(_PLANS, key, lambda: _build_plan(op, leaves, treedef, grown, length, capacity, specs, slots,
                                                   len(scalars), exact_leaves))
    if plan is None:
        return None
    kernel, out_dims = plan

    def finish(result):
        flat, spec = tree_flatten(result)
        out = []
        for t, d in zip(flat, out_dims):
            if d is None:
                out.append(t)
                continue
            shape = list(t.shape)
            shape[d] = length
            out.append(strided_over(t, shape, _capacity_strides(shape, d, capacity), capacity))
        return tree_unflatten(out, spec)

    return kernel, [x for x in leaves if isinstance(x, torch.Tensor)], buffers, scalars, finish


def _build_plan(op, leaves, treedef, grown, length, capacity, specs, slots, num_scalars, exact_leaves):
    """(kernel, grown dim of each output or None) from torch's meta kernel at the exact and the capacity
    shapes, or None where the two differ other than in one dim of ``length`` -> ``capacity``."""
    if length >= capacity:
        return None  # a full capacity: the two shapes cannot tell the grown dims apart (exact this time)
    exact = [_meta(x) for x in (exact_leaves or leaves)]
    padded = []
    for i, x in enumerate(leaves):
        sizes = None
        if i in grown:
            sizes = list(x.shape)
            sizes[grown[i][0]] = capacity
        padded.append(_meta(x, None if sizes is None else tuple(sizes)))
    try:
        want = op(*unflatten_args(exact, treedef)[0], **unflatten_args(exact, treedef)[1])
        got = op(*unflatten_args(padded, treedef)[0], **unflatten_args(padded, treedef)[1])
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    want_flat, got_flat = tree_flatten(want)[0], tree_flatten(got)[0]
    if len(want_flat) != len(got_flat) or not all(isinstance(t, torch.Tensor) for t in got_flat):
        return None
    out_dims = []
    for w, g in zip(want_flat, got_flat):
        diff = [d for d, (a, b) in enumerate(zip(w.shape, g.shape)) if a != b]
        if w.dim() != g.dim() or len(diff) > 1 or (diff and (w.shape[diff[0]], g.shape[diff[0]]) != (length, capacity)):
            return None
        if not diff and grown and op not in _MASKS_ITS_INPUTS and op not in (aten.index.Tensor,
                                                                             aten.index_select.default):
            return None  # a pointwise op whose result lost the grown dim: not expected, not guessed
        out_dims.append(diff[0] if diff else None)
    returns = ("single", None) if isinstance(got, torch.Tensor) else ("fresh", tree_flatten(got)[1])
    fresh = [(tuple(g.shape), g.dtype) for g in got_flat]
    kernel = _PaddedOp(op, treedef, tuple(specs), slots, num_scalars, capacity, fresh, returns)
    return (kernel, out_dims) if _checks(kernel, slots, num_scalars) else None
