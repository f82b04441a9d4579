"""The tpu kernels: every aten op on "tpu" tensors becomes one cached JAX program (or a fused part of one).

A tpu tensor is a real PrivateUse1 TensorImpl (sizes, strides, storage offset) over a storage that
holds a ``Buffer`` (``_storage``): every alias (views, ``detach``, ``.data``, Parameters) shares it.

One kernel serves every op (registered per op and as the PrivateUse1 fallback):
- view ops run torch's Meta kernel on the tpu tensor itself (real strides over the shared storage);
- any other op becomes a ``Kernel``, cached by a signature (op, tree structure, each tensor's
  geometry/dtype/storage slot, static arguments; Python floats are inputs, not constants, and so are
  ints that change at the same place: automatic dynamic ints, below), which
  reads its tensors out of the storages, runs the functional op through ``tpudist.ops.call`` and
  writes back every argument the schema marks written (``Tensor(a!)``: in-place, ``out=``, and ops
  like ``_native_batch_norm_legit`` that are neither) from its functional twin's results (several
  views of one storage combined); a mutating op with no twin raises rather than lose its writes;
- torch's Meta kernel runs once per signature, so shape/dtype errors are torch's own, at the op.

This module finds and builds kernels; ``_execute`` runs them in the eager mode of the moment (it imports
this module, ``_fused`` and ``_grow``; none of them imports it).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.lax import lax as _lax
from torch.utils._pytree import tree_flatten, tree_unflatten

import tpudist.ops as tops
from tpudist import matmul_precision as precision
from tpudist.device import _layouts
from tpudist.device import _runtime as rt
from tpudist.device import views
from tpudist.device import _storage
from tpudist.device._storage import (  # noqa: F401  (re-exported: the kernels module uses them from here)
    _ATTR, X64, Buffer, Lazy, Shaped, _create_empty, _fast, _retype, buffer_of, concrete, flush, from_cpu, is_tpu,
    is_whole, new_tensor, tensor_over, to_cpu, to_jax, to_torch, value_of, warn_if_emulated,
)

aten = torch.ops.aten
META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)  # noqa: SLF001
PRECISION = precision.STATE
_F64 = np.dtype("float64")


# -- signatures and kernels --------------------------------------------------------------------------

_KERNELS: dict = {}
_ids = itertools.count()
_STATIC_FLOAT_OPS: set = set()
_FUNCTIONAL_ALIASES = {
    aten.normal_.default: aten.normal_functional.default,
}


class Kernel:
    """One op on one signature: what it reads, what it computes, what it writes.

    A mutating op runs as its functional twin, whose results follow ``plan``: one entry per result,
    ("write", leaf indices) for the new value of a written argument, ("fresh", None) for an output.
    """

    present = None  # functional ops with None among torch's results: which flattened results are tensors
    matmul = False  # whether torch's float32 matmul precision decides its program (set by ``check``)
    host_checks = False  # whether its program checks values on the host (an assert: tpudist.ops.host_checks)

    def __init__(self, op, functional, form, treedef, leaf_specs, slots, plan, n_scalars, random,
                 fresh, returns):
        self.id = next(_ids)
        self.op, self.functional, self.form = op, functional, form
        self.treedef, self.leaf_specs, self.slots = treedef, leaf_specs, slots
        self.plan = plan                # None for a functional op: every result is fresh
        self.targets = [leaf for kind, leaves in plan or () if kind == "write" for leaf in leaves]
        self.n_scalars, self.random = n_scalars, random
        self.fresh = fresh              # [(shape, torch dtype[, strides])] of fresh outputs, after the written slots
        self.returns = returns          # how to build the Python result from targets/fresh
        self.written_slots = sorted({leaf_specs[i][1] for i in self.targets})
        self.num_written = len(self.written_slots)
        self.out_names = {a.name for a in op._schema.arguments if a.is_out}  # noqa: SLF001
        # a factory's out= form (logspace.out) computes in its out tensor's dtype: its twin takes dtype=
        self.dtype_from_out = form == "out" and _takes_dtype(functional) and not _takes_dtype(op)
        self.single = len(functional._schema.returns) == 1  # noqa: SLF001
        self.jitted = jax.jit(self._run)  # no defaulted parameters: those take jit's slow path
        self.jitted_plain = jax.jit(self._run_plain)
        rt.stats["kernels"] += 1

    def __repr__(self):
        return f"Kernel({self.op})"

    @property
    def returns(self):
        return self._returns

    @returns.setter
    def returns(self, value):
        # a foreach op's list of fresh tensors is built as a list, not through torch's pytree (~35 us
        # for 20 tensors): ``flat_type`` is list/tuple when the results are one flat list/tuple
        self._returns = value
        self.single_result = value is not None and value[0] == "single"
        info = value[1] if value is not None and value[0] == "fresh" else None
        self.flat_type = None
        if (info is not None and info.type in (list, tuple)
                and all(child.is_leaf() for child in info.children())):
            self.flat_type = info.type

    @property
    def fresh(self):
        return self._fresh

    @fresh.setter
    def fresh(self, value):
        # the hot paths make each output from (shape, dtype, numel[, strides]), computed once here; an
        # output with strides holds its value in their physical order (``orders``: None where that is
        # row-major)
        self._fresh = value
        self.outputs = self.orders = None
        if value is not None:
            self.outputs, self.orders = zip(*(_output(*entry) for entry in value)) if value else ((), ())
            for entry in value:  # a kernel that makes float64 on a TPU (a factory, .double()) warns once
                warn_if_emulated(entry[1])

    def _run(self, arrays, sc):
        return self.trace(arrays, sc)

    def _run_plain(self, arrays):
        return self.trace(arrays, None)  # a call without runtime scalars: nothing may index them

    def check(self, arrays, sc):
        """Traces the kernel on abstract ``arrays`` and ``sc`` (under x64), so a lowering error is
        raised at the op, and notes whether its program holds a dot or convolution: only those ops
        read torch's float32 matmul precision when they run (~0.2 us an op)."""
        self.matmul = precision.uses_precision(jax.make_jaxpr(self.trace)(arrays, sc))

    def storages(self, arrays):
        """The flat storages the kernel reads: ``arrays``, with zeros for a storage never written."""
        return [a if a is not None else jnp.zeros((numel,), tops.to_jax_dtype(dtype))
                for a, (numel, dtype) in zip(arrays, self.slots)]

    def discover(self, arrays, sc):
        """Abstract results of an op torch has no meta kernel for: the outputs' shapes and structure."""
        self.fresh = ()
        result = self.trace(arrays, sc, 0, raw=True)
        if self.plan is not None:  # a mutating op: only its fresh results are outputs
            results = (result,) if self.single else tuple(result)
            result = [r for (kind, _), r in zip(self.plan, results) if kind == "fresh"]
        flat, self.result_def = tree_flatten(result)
        return flat

    def trace(self, arrays, sc, base=0, raw=False):
        flats = self.storages(arrays)
        leaves = []
        for spec in self.leaf_specs:
            kind = spec[0]
            if kind == "T":
                _, slot, sizes, strides, offset, dtype = spec
                leaves.append(views.read_as(flats[slot], sizes, strides, offset, tops.to_jax_dtype(dtype)))
            elif kind == "B":  # a view with torch's lazy conjugate / negative bit: apply it on reading
                _, slot, sizes, strides, offset, dtype, conj, neg = spec
                value = views.read_as(flats[slot], sizes, strides, offset, tops.to_jax_dtype(dtype))
                value = jnp.conj(value) if conj else value
                leaves.append(-value if neg else value)
            elif kind == "F":
                leaves.append(_weak(sc[base + spec[1]]))
            elif kind == "C":
                leaves.append(_weak(sc[base + spec[1]]).astype(tops.to_jax_dtype(spec[2])))
            elif kind == "I":
                leaves.append(jnp.asarray(spec[1], tops.to_jax_dtype(spec[2])))
            elif kind == "D":  # a generalised int: a runtime input (weak like a Python int, or the tensor's dtype)
                value = sc[base + spec[1]]
                leaves.append(_weak_int(value) if spec[2] is None else value.astype(tops.to_jax_dtype(spec[2])))
            elif kind == "V":  # a view at a runtime storage offset
                _, slot, sizes, strides, index, dtype = spec
                leaves.append(views.read_at(flats[slot], sizes, strides, _offset(sc[base + index]),
                                            tops.to_jax_dtype(dtype)))
            else:
                leaves.append(spec[1])
        args, kwargs = unflatten_args(leaves, self.treedef)
        if self.form == "out":
            if self.dtype_from_out:
                kwargs["dtype"] = tops.to_torch_dtype(kwargs[next(iter(self.out_names))].dtype)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.out_names}
        if tops.reads_contiguity(self.functional):
            kwargs = {**kwargs, "input_contiguous": _first_tensor_contiguous(self.leaf_specs)}
        if self.random:
            seed = sc[base + self.n_scalars].astype(jnp.uint32)
            count = sc[base + self.n_scalars + 1].astype(jnp.uint32)
            key = jax.random.fold_in(jax.random.key(seed), count)
            with tops.keys(tops.KeySource(key)):
                result = tops.call(self.functional, *args, **kwargs)
        else:
            result = tops.call(self.functional, *args, **kwargs)
        if raw:
            return result
        if self.plan is None:
            fresh = tree_flatten(result)[0]
            if self.present is not None:  # outputs torch returns as None (a backward's output_mask)
                fresh = [r for r, keep in zip(fresh, self.present) if keep]
        else:
            fresh = self._write(flats, (result,) if self.single else tuple(result), sc, base)
        if len(fresh) != len(self.fresh):
            raise AssertionError(f"{self.op}: lowering returned {len(fresh)} tensors, torch {len(self.fresh)}")
        fresh = [_physical(_cast(r, shape, dtype), order)
                 for r, (shape, dtype, *_), order in zip(fresh, self.fresh, self.orders)]
        return [flats[s] for s in self.written_slots] + fresh

    def _write(self, flats, results, sc, base):
        """Write the functional twin's new values of the written arguments into their storages; the
        fresh results, flattened."""
        if len(results) != len(self.plan):
            raise AssertionError(f"{self.op}: its functional twin {self.functional} returned {len(results)} "
                                 f"results, expected {len(self.plan)}")
        fresh = []
        for (kind, targets), value in zip(self.plan, results):
            if kind == "fresh":
                fresh.extend(tree_flatten(value)[0])
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            if len(values) != len(targets):
                raise AssertionError(f"{self.op}: {self.functional} returned {len(values)} values for "
                                     f"{len(targets)} written tensors")
            for leaf, v in zip(targets, values):
                kind, slot, sizes, strides, offset, dtype = self.leaf_specs[leaf]
                v = _cast(v, sizes, dtype)
                if kind == "V":
                    flats[slot] = views.write_at(flats[slot], v, sizes, strides, _offset(sc[base + offset]))
                else:
                    flats[slot] = views.write_as(flats[slot], v, sizes, strides, offset)
        return fresh


def _takes_dtype(op) -> bool:
    return any(a.name == "dtype" for a in op._schema.arguments)  # noqa: SLF001


def _output(shape, dtype, strides=None):
    """(output spec, physical order) of a fresh result: contiguous unless ``strides`` (torch's, from the
    meta kernel) say otherwise and are dense; other layouts (gaps, overlaps) come out contiguous."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if strides is None or tuple(strides) == views.contiguous_strides(shape):
        return (shape, dtype, numel), None
    order = views.permuted_order(shape, strides)
    if order is None:
        return (shape, dtype, numel), None
    strides = tuple(strides)
    return (shape, dtype, numel, strides), None if views.is_contiguous(shape, strides) else order


def _physical(value, order):
    """A result as the flat storage of its layout: row-major, or of ``value.permute(order)``."""
    return (value if order is None else jnp.transpose(value, order)).reshape(-1)


def _weak(x):
    return _lax._convert_element_type(x, _F64, weak_type=True)  # noqa: SLF001


def _weak_int(x):
    return _lax._convert_element_type(x, np.dtype("int64"), weak_type=True)  # noqa: SLF001


def _offset(x):
    return x.astype(jnp.int64)




def _cast(value, shape, dtype):
    want = tops.to_jax_dtype(dtype)
    if value is None:
        # a lowering leaves out a result its output_mask turned off where torch's meta kernel still
        # promises a tensor (native_batch_norm_backward): autograd drops it, so zeros stand in
        return jnp.zeros(tuple(shape), want)
    value = jnp.asarray(value)
    if value.dtype != want:
        value = value.astype(want)
    if tuple(value.shape) != tuple(shape):
        value = jnp.broadcast_to(value, tuple(shape))
    return value


def flatten_args(args, kwargs):
    """(leaves, structure) of an op's arguments: lists/tuples of one level flattened (foreach ops).

    torch's pytree is general but costs ~30 us per call; aten arguments nest at most one level.
    """
    leaves, struct = [], []
    names = tuple(kwargs)
    for a in (*args, *(kwargs[k] for k in names)):
        if type(a) in (list, tuple):
            struct.append((type(a), len(a)))
            leaves.extend(a)
        else:
            struct.append(None)
            leaves.append(a)
    return leaves, (tuple(struct), len(args), names)


def unflatten_args(leaves, structure):
    struct, num_args, names = structure
    values, i = [], 0
    for entry in struct:
        if entry is None:
            values.append(leaves[i])
            i += 1
        else:
            kind, n = entry
            values.append(kind(leaves[i:i + n]))
            i += n
    return tuple(values[:num_args]), dict(zip(names, values[num_args:]))


def _device_mismatch(op, other):
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"tpu:0 and {other.device}! (when running {op} on the tpu device; move the tensor "
                        "with .to('tpu') or .cpu())")


def _signature_py(op, args, kwargs, static_floats: bool):
    """(key, leaves, slot buffers, scalar values) of one call; leaves are described, not copied.

    The reference: ``_signature`` is its C++ twin (``_fastpath``) where that built, with the same keys.

    This runs for every op (it is most of an op's host cost in Fused mode): one pass over the leaves,
    no pytree, each tensor's facts read once (each read is a C call of ~60-160 ns, the floor of this
    function: benchmarks/device_step.py prints it). A tensor's storage without a device buffer is a
    host tensor (a CPU scalar) or a foreign one: looked at only then.
    """
    if kwargs:
        leaves, treedef = flatten_args(args, kwargs)
    else:
        for a in args:
            if a.__class__ is list or a.__class__ is tuple:
                leaves, treedef = flatten_args(args, kwargs)
                break
        else:  # the common case: positional leaves only, no lists
            leaves = args
            treedef = _FLAT_TREEDEFS.get(len(args))
            if treedef is None:
                treedef = _FLAT_TREEDEFS[len(args)] = flatten_args(args, {})[1]
    sig = []
    slot_of: dict = {}
    buffers: list[Buffer] = []
    slots: list = []
    scalars: list[float] = []
    for x in leaves:
        if isinstance(x, _Tensor):
            buf = getattr(x.untyped_storage(), _ATTR, None)
            if buf is None:
                sig.append(_host_spec(op, x, scalars, static_floats))
                continue
            slot = slot_of.get(buf)
            if slot is None:
                slot = slot_of[buf] = len(buffers)
                buffers.append(buf)
                slots.append((buf.numel, buf.dtype, buf.value is None))
            # torch.Size hashes and compares as the tuple it is (_build keeps plain tuples)
            sizes, strides, dtype = x.shape, x.stride(), x.dtype
            if 1 in sizes:  # a size-1 dim's stride is never used: one key for x[:, -1:] of any length
                strides = tuple(0 if n == 1 else st for n, st in zip(sizes, strides))
            # torch's conj fallback reaches us with the bit still set; only complex tensors carry
            # the conj bit, any dtype the neg bit (x.conj().imag)
            if x.is_neg() or (dtype in _COMPLEX and x.is_conj()):
                sig.append(("B", slot, tuple(sizes), strides, x.storage_offset(), dtype, x.is_conj(),
                            x.is_neg()))
            else:
                sig.append(("T", slot, sizes, strides, x.storage_offset(), dtype))
        elif x.__class__ is float and not static_floats:
            sig.append(("F", len(scalars)))
            scalars.append(x)
        elif isinstance(x, torch.device) and x.type == "tpu":
            sig.append(("S", _META_DEVICE))  # lowerings ignore it; tops.call's meta run must not allocate
        elif x.__class__ is bool:  # not ("S", True): that equals ("S", 1), whose result may be int64, not bool
            sig.append(("Z", x))
        elif x.__class__ is float or x.__class__ is complex:  # ("S", 2.0) equals ("S", 2): the class decides the dtype
            sig.append(("S", x, x.__class__))
        else:
            sig.append(("S", x if not isinstance(x, list) else tuple(x)))
    key = (id(op), treedef, tuple(sig), tuple(slots), static_floats)  # id: OpOverload.__hash__ is Python
    return key, leaves, buffers, scalars


def _host_spec(op, x, scalars, static_floats):
    """The spec of a tensor argument without a device buffer: a CPU 0-dim scalar, else a device mismatch."""
    if not x.is_cpu or x.dim() != 0:
        raise _device_mismatch(op, x)
    if x.dtype.is_floating_point and not static_floats:
        scalars.append(float(x.item()))
        return ("C", len(scalars) - 1, x.dtype)
    return ("I", x.item(), x.dtype)


_Tensor = torch.Tensor
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


_FLAT_TREEDEFS: dict = {}


def _plain_sizes(key):
    """``key`` with its tensors' sizes as tuples, not torch.Size: equal, but their repr (the on-disk
    program key) differs."""
    sig = tuple((spec[0], spec[1], tuple(spec[2]), *spec[3:]) if spec[0] in ("T", "V", "B") else spec
                for spec in key[2])
    return (key[0], key[1], sig, *key[3:])


def _first_tensor_contiguous(leaf_specs) -> bool:
    """torch's ``is_contiguous()`` of the first tensor argument, from its spec (sizes, strides)."""
    for spec in leaf_specs:
        if spec[0] in ("T", "B", "V"):
            sizes, strides = spec[2], spec[3]
            return 0 in sizes or views.is_contiguous(sizes, strides)
    return True


def _meta_of(x):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("meta")
    return x


def _build(op, key, leaves):
    key = _plain_sizes(key)
    _, treedef, sig, slots, static_floats = key
    # torch's own shape/dtype checks and result metadata, once per signature
    meta_leaves = [_meta_of(x) for x in leaves]
    margs, mkwargs = unflatten_args(meta_leaves, treedef)
    try:
        meta = _NO_META if tops.uses_lowering_shapes(op) else op(*margs, **mkwargs)  # see shapes_from_lowering
    except (NotImplementedError, RuntimeError) as e:
        # no meta kernel, or one that needs the data (repeat_interleave's repeats without output_size:
        # "cannot repeat_interleave a meta tensor ..."): JAX's abstract evaluation gives the shapes, or
        # says they depend on the data (then the op runs concretely)
        no_meta_kernel = isinstance(e, NotImplementedError) and ("Meta" in str(e) or "meta" in str(e))
        if not (no_meta_kernel or "meta tensor" in str(e)):
            raise
        meta = _NO_META
    schema = op._schema  # noqa: SLF001
    mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        functional = functional_twin(op)
        form = "out" if any(schema.arguments[i].is_out for i in mutated) else "mutating"
        arg_leaves = _argument_leaves(schema, treedef, len(leaves))
        plan, entries = _mutation_plan(schema, arg_leaves)
        targets = [leaf for kind, ls in plan if kind == "write" for leaf in ls]
        for t in targets:
            if sig[t][0] == "B":
                raise tops.UnsupportedOp(op, " (writing through a lazily conjugated or negated view; "
                                             "call resolve_conj() / resolve_neg() first)")
            if sig[t][0] not in ("T", "V"):
                raise _device_mismatch(op, leaves[t])
        # out= with a shape change: the meta kernel resized the meta out tensor
        resize = [(t, tuple(meta_leaves[t].shape)) for t in targets
                  if tuple(meta_leaves[t].shape) != sig[t][2]]
        if resize:
            raise _ResizeOut(resize)
        fresh = None
        if meta is not _NO_META:
            metas = (meta,) if len(schema.returns) == 1 else tuple(meta or ())
            flat_meta = [m for (kind, _, _), m in zip(entries, metas) if kind == "fresh"]
            if not all(isinstance(m, torch.Tensor) for m in flat_meta):
                raise tops.UnsupportedOp(op, " (a mutating op whose other results are not single tensors)")
            fresh = _fresh_of(op, margs, flat_meta)
        returns = ("mutating", entries)
    elif meta is _NO_META:
        functional, form, plan, fresh, returns = op, "functional", None, None, None
    else:
        functional, form, plan = op, "functional", None
        flat_meta, meta_def = tree_flatten(meta)
        if not all(isinstance(m, torch.Tensor) or m is None for m in flat_meta):
            raise _DataDependent()
        # None results (convolution_backward's or native_batch_norm_backward's masked-off gradients)
        # are not outputs of the program: the kernel drops the lowering's value there
        present = tuple(m is not None for m in flat_meta)
        fresh = _fresh_of(op, margs, [m for m in flat_meta if m is not None])
        returns = ("single", None) if isinstance(meta, torch.Tensor) else ("fresh", meta_def)
    n_scalars = sum(1 for s in sig if s[0] in _RUNTIME_KINDS)
    random = torch.Tag.nondeterministic_seeded in functional.tags
    specs = list(sig)
    kernel = Kernel(op, functional, form, treedef, specs, [(n, d) for n, d, _ in slots], plan,
                    n_scalars, random, fresh, returns)
    if plan is None and meta is not _NO_META and not all(present):
        kernel.present = present
    kernel.stable_id = hashlib.sha256(repr((str(op), key[1:], _code_of(tops.lowering_for(functional))))
                                      .encode()).hexdigest()[:24]
    # trace once now: a missing lowering or a lowering error is raised here, at the op
    sc = jax.ShapeDtypeStruct((n_scalars + 2 * random,), _F64)
    arrays = [None if uninit else jax.ShapeDtypeStruct((n,), tops.to_jax_dtype(d)) for n, d, uninit in slots]
    with jax.enable_x64(True):
        if fresh is None:
            try:
                shapes = jax.eval_shape(kernel.discover, arrays, sc)
            except (jax.errors.ConcretizationTypeError, TypeError) as e:
                if kernel.plan is not None:  # run_concrete would drop the op's writes
                    raise tops.UnsupportedOp(op, " (a mutating op whose results' shapes depend on the data)") from e
                raise _DataDependent() from e
            found = [tuple(s.shape) for s in shapes]
            strides = _layouts.result_strides(op, margs, found, [None] * len(found))
            kernel.fresh = [(shape, tops.to_torch_dtype(s.dtype), st) for shape, s, st in zip(found, shapes, strides)]
            if kernel.plan is None:
                kernel.returns = ("fresh", kernel.result_def)
        kernel.check(arrays, sc)
    return kernel


def _fresh_of(op, margs, metas) -> list:
    """(shape, dtype, strides) of each fresh result, from torch's meta results (``_layouts``)."""
    shapes = [tuple(m.shape) for m in metas]
    strides = _layouts.result_strides(op, margs, shapes, [tuple(m.stride()) for m in metas])
    return [(shape, m.dtype, s) for shape, m, s in zip(shapes, metas, strides)]


def functional_twin(op):
    """The functional op that computes what a mutating ``op`` writes, or raise UnsupportedOp.

    In-place ``add_`` -> ``add``; ``add.out`` -> ``add.Tensor``; any other op with written arguments
    (``_native_batch_norm_legit``'s running_mean(a!)/running_var(a!), ``rrelu_with_noise``'s noise(b!))
    -> torchgen's generated ``<name>_functional``. Its results must be the op's returns followed by the
    new value of every written argument no return aliases (checked here, against its schema).
    """
    schema = op._schema  # noqa: SLF001
    want = len(schema.returns) + len(_unreturned_writes(schema))
    candidates = [c for c in (_FUNCTIONAL_ALIASES.get(op), tops.functional_of(op), _generated_functional(op))
                  if c is not None]
    for twin in candidates:  # rrelu_with_noise_ -> rrelu_with_noise mutates too: the generated twin then
        if not twin._schema.is_mutable and len(twin._schema.returns) == want:  # noqa: SLF001
            return twin
    raise NoFunctionalTwin(op, want, candidates)


class NoFunctionalTwin(tops.UnsupportedOp):
    """A mutating op the device cannot run without losing its writes (the CPU fallback can)."""

    def __init__(self, op, want: int, candidates):
        NotImplementedError.__init__(self, (
            f"{op} writes into its arguments and has no functional twin on the tpu device: one needs an op "
            f"returning {want} values (the op's returns, then the new value of each written argument: "
            f"torchgen's <name>_functional convention); candidates={[str(c) for c in candidates]}. Running it "
            "would lose its writes: lower such a twin with @tpudist.ops.lowers, or run the op on the host "
            "with torch.tpu.set_cpu_fallback(True)"))
        self.op = self.reached = op


def _generated_functional(op):
    """torchgen's functional variant of a mutating op: ``<name>_functional`` (or ``<name>`` without its
    trailing underscore), the overload whose arguments are the op's minus its out= ones."""
    schema = op._schema  # noqa: SLF001
    namespace, name = schema.name.split("::")
    ops = getattr(torch.ops, namespace)
    want = [a.name for a in schema.arguments if not a.is_out]
    names = (name + "_functional",) if not name.endswith("_") else (name[:-1], name[:-1] + "_functional")
    for packet_name in names:
        packet = getattr(ops, packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            c = candidate._schema  # noqa: SLF001
            if not c.is_mutable and [a.name for a in c.arguments] == want:
                return candidate
    return None


def _unreturned_writes(schema) -> list[int]:
    """Written arguments no return aliases, in the order torchgen's functional variants return their new
    values (torchgen/model.py ``FunctionSchema.signature``): self, the out= arguments, then the
    positional arguments after self (all of them when there is no self)."""
    args = schema.arguments
    returned = {frozenset(r.alias_info.before_set) for r in schema.returns if r.alias_info is not None}
    names = [a.name for a in args]
    self_ix = names.index("self") if "self" in names else None
    order = ([self_ix] if self_ix is not None else []) + [i for i, a in enumerate(args) if a.is_out]
    order += [i for i, a in enumerate(args) if not a.kwarg_only and (self_ix is None or i > self_ix)]
    return [i for i in order if args[i].alias_info is not None and args[i].alias_info.is_write
            and frozenset(args[i].alias_info.before_set) not in returned]


def _argument_leaves(schema, treedef, n_leaves) -> list[list[int]]:
    """The leaf indices of each schema argument (a list argument has several; an absent one none)."""
    args, kwargs = unflatten_args(list(range(n_leaves)), treedef)
    out = []
    for i, a in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out.append(list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value])
    return out


def _mutation_plan(schema, arg_leaves):
    """(plan, entries) of a mutating op. ``plan``: what each result of its functional twin is, ("write",
    leaves) or ("fresh", None); ``entries``: what each of the op's own returns is, ("write", leaves,
    is_list) or ("fresh", None, None)."""
    by_alias = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            by_alias[frozenset(a.alias_info.before_set)] = i
    plan, entries = [], []
    for r in schema.returns:
        i = by_alias.get(frozenset(r.alias_info.before_set)) if r.alias_info is not None else None
        if i is None:
            plan.append(("fresh", None))
            entries.append(("fresh", None, None))
        else:
            plan.append(("write", arg_leaves[i]))
            entries.append(("write", arg_leaves[i], isinstance(r.type, torch.ListType)))
    plan.extend(("write", arg_leaves[i]) for i in _unreturned_writes(schema))
    return plan, entries


_NO_META = object()
_META_DEVICE = torch.device("meta")
_NO_SCALARS = np.zeros((0,), _F64)


class _ResizeOut(Exception):
    """out= tensors of the wrong shape: resize them (as torch's resize_output does), then retry."""

    def __init__(self, resize):
        super().__init__(resize)
        self.resize = resize


class _DataDependent(Exception):
    """The op's result is not a tensor of known shape (item, equal, nonzero ...): run it concretely."""


def _code_of(fn) -> str:
    """What a lowering computes, for on-disk program keys: a changed lowering must not hit old programs."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn) if " at 0x" not in repr(fn) else type(fn).__qualname__
    return _hash_code(code)


def _hash_code(code) -> str:
    digest = hashlib.sha256(code.co_code + repr(code.co_names).encode())
    for const in code.co_consts:  # nested functions: their code, not their repr (it holds an address)
        digest.update((_hash_code(const) if hasattr(const, "co_code") else repr(const)).encode())
    return digest.hexdigest()


def kernel_for(op, args, kwargs):
    static = id(op) in _STATIC_FLOAT_OPS
    key, leaves, buffers, scalars = _signature(op, args, kwargs, static)
    return _resolve(op, args, kwargs, static, key, leaves, buffers, scalars)


def _resolve(op, args, kwargs, static, key, leaves, buffers, scalars):
    """(kernel, leaves, buffers, scalars) of a call's signature: cached, generalised or built."""
    dynamic = rt.dynamic_scalars()
    kernel = _KERNELS.get(key)
    if kernel.__class__ is _Generalised:
        if dynamic:
            rt.stats["hits"] += 1
            return kernel.kernel, leaves, buffers, scalars + kernel.ints
        kernel = None
    if kernel is not None:
        rt.stats["hits"] += 1
        return kernel, leaves, buffers, scalars
    if dynamic:
        promoted = _promote(op, key, leaves, scalars, buffers)
        if promoted is not None:
            kernel, general_scalars = promoted
            global _num_generalised
            if _num_generalised < _MAX_GENERALISED:  # an int counting up forever must not grow the table forever
                _num_generalised += 1
                _KERNELS[key] = _Generalised(kernel, general_scalars[len(scalars):])
            return kernel, leaves, buffers, general_scalars
    rt.stats["misses"] += 1
    try:
        kernel = _build(op, key, leaves)
    except _ResizeOut as e:
        for leaf, shape in e.resize:
            leaves[leaf].resize_(shape)
        return kernel_for(op, args, kwargs)
    except TypeError as e:  # JAX's concretization errors are TypeErrors too
        # A decomposition that branches on a float argument (torch._check(delta > 0) raises "cond
        # must be a bool") gets a traced value when the float is a program input: run the op with its
        # floats as constants instead.
        concretization = isinstance(e, (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                                        jax.errors.TracerIntegerConversionError))
        if static or not (concretization or "cond must be a bool" in str(e)):
            raise
        _STATIC_FLOAT_OPS.add(id(op))
        return kernel_for(op, args, kwargs)
    _KERNELS[key] = kernel
    if dynamic:
        site, values = _site_of(op, key)
        if values and site not in _SITES:
            _SITES[site] = _Site(values, kernel)
    return kernel, leaves, buffers, scalars


# -- automatic dynamic ints --------------------------------------------------------------------------
#
# An int the signature holds as a constant (a Python int argument of an int/Scalar parameter, a 0-dim
# int CPU tensor, a view's storage offset) is compiled into the kernel. As Dynamo's automatic dynamic
# does, the first value seen at a place (a "site": the signature with those ints left out) stays a
# constant; when a second, different value arrives there, that int becomes a runtime input of the
# kernel (in the float64 scalar vector: exact below 2**53, on a TPU below 2**47) and every later value
# reuses the kernel.
# An int that decides a shape (torch's meta kernel gives other result shapes for the two values) or
# that a lowering needs as a Python value (JAX raises a concretization error while tracing) stays a
# constant at that site. The first value keeps its constant kernel, so a second run (a second
# generate call) records the same kernels as the first and reuses its fused programs. A new site that
# differs from a generalised one only in its storages' sizes (a cache in a longer sequence, token ids
# moved to the next capacity) takes the same ints as inputs at once (a "hint").

_SITES: dict = {}
_HINTS: dict = {}
# storages ``_grow`` gave a bucketed capacity (grown Buffer -> capacity; ``_grow.CAPACITY``): sequences
# that grow every step. A view into one at a nonzero offset (``ids[:, -1:]``) is a position along the
# sequence, which moves every step: it is a runtime input from its first value (a constant first would
# cost the decoding loop one more program, at the step after the sequence moved into its capacity)
CAPACITY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEVER = object()  # a hinted site's "first value": no value stays a constant there
_ELIGIBLE: dict = {}
_RUNTIME_KINDS = ("F", "C", "D", "V")
_EXACT = 2 ** 53  # float64 holds every int below this exactly
# a TPU's float64 is a pair of float32 (docs/device.md, Limits): 48 bits of significand, and ints near
# 2**53 measured up to 8 off after a copy to the chip; the bound keeps a margin below 2**48
_EXACT_ON_TPU = 2 ** 47
_MAX_GENERALISED = 1 << 16  # signatures remembered as generalised; beyond, each call is generalised anew
_num_generalised = 0
# parameters whose int value picks a different computation in the lowerings, not just a number in it:
# pow's integer exponent (x*x, exact like torch, vs a float power) and addmm's beta=0 (ignore the bias,
# NaNs included); the rest of an op's ints are safe as inputs or refused by tracing
_NOT_RUNTIME_INTS = ("dtype", "layout", "memory_format", "exponent", "beta")


class _Generalised:
    """What a signature with constant ints maps to once some of them are inputs: the kernel, and the
    values of those ints (the signature holds them: one entry per distinct value, one kernel for all)."""

    __slots__ = ("kernel", "ints")

    def __init__(self, kernel, ints):
        self.kernel, self.ints = kernel, ints


class _Site:
    __slots__ = ("first", "kernel", "dynamic", "static")

    def __init__(self, first, kernel):
        self.first = first          # ((position, value at the first call), ...) of the candidate ints
        self.kernel = kernel        # the kernel built for them: its result shapes are the reference
        self.dynamic = frozenset()  # positions (indices into the signature) that are runtime inputs
        self.static = set()         # positions that must stay constants


def _eligible_leaves(op, treedef, n_leaves) -> frozenset:
    """Leaves whose schema parameter is a single int, number or tensor, not a dim, dtype or layout."""
    cached = _ELIGIBLE.get((id(op), treedef))
    if cached is not None:
        return cached
    schema = op._schema  # noqa: SLF001
    eligible = set()
    for a, leaves in zip(schema.arguments, _argument_leaves(schema, treedef, n_leaves)):
        t = a.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        # a Python int where the schema says Tensor is a wrapped scalar (add.Tensor(x, 3))
        if (isinstance(t, (torch.IntType, torch.SymIntType, torch.NumberType, torch.TensorType)) and "dim" not in a.name
                and a.name not in _NOT_RUNTIME_INTS):
            eligible.update(leaves)
    _ELIGIBLE[(id(op), treedef)] = result = frozenset(eligible)
    return result


def _site_of(op, key):
    """(site, values): the signature with its candidate ints left out, and those ints in order."""
    _, treedef, sig, slots, static_floats = key
    eligible = _eligible_leaves(op, treedef, len(sig))
    masked, values = list(sig), []
    for i, spec in enumerate(sig):
        kind = spec[0]
        if kind == "S":
            if type(spec[1]) is int and i in eligible:
                masked[i] = ("S", None)
                values.append((i, spec[1]))
        elif kind == "Z":
            if i in eligible:
                masked[i] = ("Z", None)
                values.append((i, spec[1]))
        elif kind == "I":
            if not (spec[2].is_floating_point or spec[2].is_complex or spec[2] == torch.bool):
                masked[i] = ("I", None, spec[2])
                values.append((i, spec[1]))
        elif kind == "T":
            _, slot, sizes, strides, offset, dtype = spec
            # a phase (RoPE's odd elements, views.phase) or a column among a few (rotate_half's halves,
            # views.few_columns) stays a constant: as a runtime input it made the read a dynamic slice of
            # the whole flat storage, where a constant is a static strided pick
            if (dtype == slots[slot][1] and all(sizes) and min(strides, default=0) >= 0
                    and not views.phase(sizes, strides, offset) and not views.few_columns(sizes, strides, offset)):
                masked[i] = ("T", slot, sizes, strides, None, dtype)
                values.append((i, offset))
    return (key[0], treedef, tuple(masked), slots, static_floats), tuple(values)


def _exact_ints() -> int:
    """The ints the scalar vector carries exactly are those of magnitude below this."""
    return _EXACT_ON_TPU if _storage._on_tpu() else _EXACT  # noqa: SLF001


def _generalise(key, scalars, positions):
    """(key, scalars) with the ints at ``positions`` as runtime inputs; None if one is too large."""
    sig, scalars = list(key[2]), list(scalars)
    exact = _exact_ints()
    for i in sorted(positions):
        spec = sig[i]
        if spec[0] == "T":
            value, general = spec[4], ("V", *spec[1:4], len(scalars), spec[5])
        else:
            dtype = spec[2] if spec[0] == "I" else torch.bool if spec[0] == "Z" else None
            value, general = spec[1], ("D", len(scalars), dtype)
        if not -exact < value < exact:
            return None
        scalars.append(value)
        sig[i] = general
    return (key[0], key[1], tuple(sig), key[3], key[4]), scalars


def _hint_of(site):
    """A site without its storages' sizes: a sequence in a storage of the next capacity, the same cache
    in a model of another length, inherit the ints their siblings made runtime inputs."""
    return site[0], site[1], site[2], tuple(slot[1:] for slot in site[3]), site[4]


def _inputs_at_once(key, values, buffers) -> frozenset:
    """The positions of ``values`` that are runtime inputs from their first value: Python bools for a
    number (a flag Python computes each step, such as Hugging Face's stopping flag
    ``torch.full((batch,), is_done)``, flips once, at the last step: as a constant first, that step alone
    compiled a program), and nonzero storage offsets into a grown storage (``CAPACITY``)."""
    sig = key[2]
    return frozenset(i for i, v in values if sig[i][0] == "Z" or (
        v and sig[i][0] == "T" and CAPACITY and buffers[sig[i][1]] in CAPACITY))


def _promote(op, key, leaves, scalars, buffers):
    """A kernel with the ints that changed at this site as runtime inputs, or None (build it static)."""
    site, values = _site_of(op, key)
    entry = _SITES.get(site)
    if entry is None:
        hinted = _HINTS.get(_hint_of(site), frozenset()) | _inputs_at_once(key, values, buffers)
        if not hinted:
            return None
        general = _generalise(key, scalars, hinted)
        if general is None:
            return None
        rt.stats["misses"] += 1
        try:
            kernel = _build(op, general[0], leaves)
        except Exception:  # noqa: BLE001 - as below: this site keeps its ints constant
            return None
        # no first value stays a constant at the hinted places
        entry = _SITES[site] = _Site(tuple((i, _NEVER if i in hinted else v) for i, v in values), kernel)
        entry.dynamic = hinted
        _KERNELS[general[0]] = kernel
        return kernel, general[1]
    changed = {i for (i, v), (_, first) in zip(values, entry.first) if v != first}
    new = changed - entry.dynamic - entry.static
    positions = changed - entry.static
    if not positions:
        return None
    general = _generalise(key, scalars, positions)
    if general is None:
        return None
    gkey, gscalars = general
    kernel = _KERNELS.get(gkey)
    if kernel is None:
        rt.stats["misses"] += 1
        try:
            kernel = _build(op, gkey, leaves)
        except Exception:  # noqa: BLE001 - a lowering needs the value (concretization) or rejects a tracer
            kernel = None
        if kernel is None or kernel.fresh != entry.kernel.fresh or kernel.returns != entry.kernel.returns:
            entry.static |= new
            rt.stats["dynamic_ints_refused"] += len(new)
            return None
        _KERNELS[gkey] = kernel
    if new:
        entry.dynamic = entry.dynamic | new
        hint = _hint_of(site)
        _HINTS[hint] = _HINTS.get(hint, frozenset()) | new
        rt.stats["dynamic_ints"] += len(new)
    return kernel, gscalars


def result_of(kernel, leaves, fresh_tensors):
    kind, info = kernel.returns
    if kind == "single":
        return fresh_tensors[0]
    if kind == "fresh":
        if kernel.flat_type is not None and kernel.present is None:
            return kernel.flat_type(fresh_tensors)
        if kernel.present is not None:
            fresh = iter(fresh_tensors)
            fresh_tensors = [next(fresh) if keep else None for keep in kernel.present]
        return tree_unflatten(fresh_tensors, info)
    fresh = iter(fresh_tensors)
    values = []
    for what, targets, is_list in info:  # "mutating": the op's returns, written arguments or outputs
        if what == "fresh":
            values.append(next(fresh))
        else:
            values.append([leaves[i] for i in targets] if is_list else leaves[targets[0]])
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# the per-op signature: C++ where it built (same keys; it hands odd calls to _signature_py), else Python
_signature = _signature_py
if _fast is not None:
    _fast.init(_signature_py, _host_spec, _META_DEVICE, torch.Tensor, torch.nn.Parameter, _ATTR)
    _signature = _fast.signature
