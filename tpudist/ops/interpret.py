"""Run one aten op on JAX arrays: its lowering, else a decomposition traced through the table.

``call(op, *args, **kwargs)`` is the single entry point the device, the compile backend and the
kernels use. Tensor arguments are JAX arrays (or tracers); results are JAX arrays cast to the dtype
torch gives (its meta kernel says which), so lowerings never re-implement torch's type promotion.
Run it with 64-bit types on (``with jax.enable_x64(True):``), or int64 tensors become int32.

An op with no lowering is decomposed, if torch has a decomposition for it, by running that Python
decomposition on ``JaxValue`` tensors (wrappers around JAX values) under ``JaxMode``, a dispatch
mode that sends every aten op it meets back through ``call``. Inside ``jax.jit`` the decomposition
traces into the same program, so a decomposed op is still one kernel. ``JaxMode`` runs in-place and
``out=`` ops as their functional twins and rebinds the written ``JaxValue``s; a write into a view
(slice, select, diagonal, as_strided, view/reshape, permute/transpose, split/unbind) is written back
into its base, and any other view write raises ``UnsupportedOp`` rather than being lost.

The meta result ``call`` casts to is cached by (op, argument shapes/dtypes, other arguments): a
cache hit costs a few microseconds, a meta kernel 50-800.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpudist import bridge
from tpudist.ops import accuracy
from tpudist.bridge import to_jax_dtype, to_torch_dtype
from tpudist.ops.registry import lowering_for, reads_contiguity, uses_lowering_shapes

aten = torch.ops.aten


class UnsupportedOp(NotImplementedError):
    """An aten op has neither a lowering nor a decomposition that reaches lowered ops.

    ``op`` is the op the caller asked for; ``reached`` the op without a lowering that its
    decomposition met (``op`` itself when there is no decomposition).
    """

    def __init__(self, op, detail: str = "", reached=None):
        self.op = op
        self.reached = op if reached is None else reached
        hint = _qualname(self.reached)
        super().__init__(f"aten op {op} has no JAX lowering in tpudist.ops{detail}; add one with "
                         f"@tpudist.ops.lowers({hint}) (a function of jax.Arrays)")


def _qualname(op) -> str:
    namespace, name = op._schema.name.split("::")  # noqa: SLF001
    return f"torch.ops.{namespace}.{name}.{op._overloadname}"  # noqa: SLF001


def tree_map(fn, x):
    """``fn`` over the leaves of nested lists/tuples/dicts; tuples come back as plain tuples.

    (torch's pytree rebuilds ``torch.return_types`` structseqs with ``type(x)(*children)``, which
    their constructor rejects: decompositions return them.)
    """
    if isinstance(x, tuple):
        return tuple(tree_map(fn, i) for i in x)
    if isinstance(x, list):
        return [tree_map(fn, i) for i in x]
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


def _meta(x):
    if _is_array(x):
        return torch.empty(x.shape, dtype=to_torch_dtype(x.dtype), device="meta")
    return x


def _signature(x):
    """A hashable stand-in for an argument: arrays by (shape, dtype), containers by their items."""
    if _is_array(x):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(i) for i in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    return (type(x), x)


_META_CACHE: dict = {}
_META_CACHE_SIZE = 8192  # distinct (op, shapes, scalars); cleared when full (scalars like lr vary per step)
_NO_META = object()


def expected_outputs(op, args, kwargs):
    """Torch's meta result of ``op`` on arguments shaped like these arrays, or None if it has none.

    Cached by op and argument signature: a meta kernel costs 50-500 us, a lookup ~5 us. None for an
    op whose meta kernel disagrees with its CPU kernel (``shapes_from_lowering``): its lowering decides.
    """
    if uses_lowering_shapes(op):
        return None
    try:
        key = (op, _signature(args), _signature(kwargs))
        hit = _META_CACHE.get(key)
    except TypeError:  # an unhashable argument (e.g. a generator): no caching
        key, hit = None, None
    if hit is None:
        hit = _run_meta(op, args, kwargs)
        if key is not None:
            if len(_META_CACHE) >= _META_CACHE_SIZE:
                _META_CACHE.clear()
            _META_CACHE[key] = hit
    return None if hit is _NO_META else hit


def _run_meta(op, args, kwargs):
    try:
        return op(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except (NotImplementedError, RuntimeError, TypeError, IndexError, ValueError,
            torch._subclasses.fake_tensor.DataDependentOutputException):  # noqa: SLF001
        # No meta kernel, or an output shape that depends on the data (nonzero, unique ...).
        return _NO_META


def _cast_like(result, meta, op):
    if result is None or meta is None:
        return result
    if isinstance(meta, torch.Tensor):
        if not _is_array(result):
            result = jnp.asarray(result)
        if tuple(result.shape) != tuple(meta.shape):
            raise AssertionError(f"lowering of {op} returned shape {tuple(result.shape)}, torch gives "
                                 f"{tuple(meta.shape)}")
        want = to_jax_dtype(meta.dtype)
        return result if result.dtype == want else result.astype(want)
    if isinstance(meta, (tuple, list)) and isinstance(result, (tuple, list)) and len(meta) == len(result):
        return type(result)(_cast_like(r, m, op) for r, m in zip(result, meta))
    return result


@functools.cache
def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = dict(decomposition_table)
    table.update(core_aten_decompositions())
    return table


def decomposition_for(op):
    """torch's decomposition of ``op`` (core ATen's first), or its CompositeImplicit kernel, or None."""
    decomp = _decompositions().get(op)
    if decomp is not None:
        return decomp
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):  # noqa: SLF001
        return op.decompose
    return None


_DECOMPOSING: contextvars.ContextVar[frozenset] = contextvars.ContextVar("tpudist_ops_decomposing",
                                                                       default=frozenset())


def call(op, *args, input_contiguous: bool = True, **kwargs):
    """``op`` on JAX arrays: its lowering, else its decomposition; results in torch's dtypes.

    ``input_contiguous``: whether the tensor behind ``op``'s first argument is contiguous, for the ops
    whose torch kernel depends on it (``registry.contiguous_input``); ignored for the others.
    """
    meta = expected_outputs(op, args, kwargs)
    lowering = lowering_for(op)
    if lowering is not None:
        if not input_contiguous and reads_contiguity(op):
            kwargs = {**kwargs, "input_contiguous": False}
        result = accuracy.run(lowering, args, kwargs)
    else:
        decomp = decomposition_for(op)
        active = _DECOMPOSING.get()
        if decomp is None or op in active:  # none, or one that calls the op itself (would recurse forever)
            raise UnsupportedOp(op, " (its decomposition calls the op itself)" if decomp is not None else "")
        token = _DECOMPOSING.set(active | {op})
        try:
            result = run_decomposition(decomp, args, kwargs, op)
            if result is NotImplemented:  # some torch decompositions decline some arguments
                raise UnsupportedOp(op, " (torch's decomposition declines these arguments)")
        except UnsupportedOp as missing:
            if missing.reached is op:
                raise
            raise UnsupportedOp(op, f" (its decomposition reached {missing.reached}, which has none)",
                                reached=missing.reached) from missing
        finally:
            _DECOMPOSING.reset(token)
    return result if meta is None else _cast_like(result, meta, op)


# -- decompositions on JAX values -------------------------------------------------------------------


class JaxValue(torch.Tensor):
    """A tensor that stands for a JAX value while a decomposition runs (shape and dtype only)."""

    value: object

    @staticmethod
    def __new__(cls, value, requires_grad=False):
        dtype = to_torch_dtype(value.dtype)
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(value.shape), dtype=dtype, device="cpu",  # noqa: SLF001
                                                requires_grad=requires_grad)
        t.value = value
        return t

    def __repr__(self):
        return f"JaxValue({self.value!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # straight to the mode's handler: re-dispatching func under a new JaxMode can land here again
        return JaxMode.__torch_dispatch__(_MODE, func, types, args, kwargs)


def _unwrap(x):
    if isinstance(x, JaxValue):
        return x.value
    if isinstance(x, torch.Tensor):
        # A constant the decomposition made outside the mode (e.g. a cached CPU tensor); numpy_view
        # takes bfloat16 (as ml_dtypes'), which Tensor.numpy() refuses.
        return jnp.asarray(bridge.numpy_view(x.detach().cpu())[0])
    return x


def _wrap(x):
    return JaxValue(x) if _is_array(x) else x


class JaxMode(TorchDispatchMode):
    """Every aten op inside runs through ``call`` on the JAX values of its ``JaxValue`` arguments."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function markers (optimizer.step): no tensors, run as is
            return func(*args, **kwargs)
        if func in (aten.detach.default, aten.lift_fresh.default, aten.alias.default):
            # a new wrapper: returning args[0] itself would make autograd's saved outputs alias their owner
            return _wrap(_unwrap(args[0]))
        if torch.Tag.inplace in func.tags or func._schema.is_mutable:  # noqa: SLF001
            return _mutate(func, args, kwargs)
        # (a JaxValue has a contiguous layout whatever made it, so input_contiguous keeps its default)
        out = tree_map(_wrap, call(func, *tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))
        if func.is_view and args and isinstance(args[0], JaxValue):
            # remember where a view came from, so that a later in-place write reaches its base
            for i, view in enumerate(out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(view, JaxValue):
                    view.view_of = (args[0], func, args[1:], kwargs, i)
        return out


_MODE = JaxMode()


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in _flat(item)]
    return [x]


def _mutate(func, args, kwargs):
    """An in-place or out= op under the mode: the functional op, then rebind the written arguments.

    The written arguments are the schema's ``Tensor(a!)`` ones (lists of them too: ``_foreach_add_``,
    ``_fused_adamw_``); the functional twin returns their new values in the same order.
    """
    from tpudist.ops.registry import functional_of

    functional = functional_of(func)
    if functional is None:
        raise UnsupportedOp(func, " (a mutating op with no functional twin)")
    schema = func._schema  # noqa: SLF001
    kwargs = dict(kwargs)
    targets, by_alias = [], {}
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.pop(arg.name) if arg.is_out else (args[i] if i < len(args) else kwargs.get(arg.name))
        targets.append(value)
        for alias in arg.alias_info.before_set:
            by_alias[alias] = value
    result = call(functional, *tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    flat_targets = _flat(targets)
    flat_results = _flat(result if len(targets) > 1 else [result])
    if len(flat_targets) != len(flat_results):
        raise UnsupportedOp(func, f" ({functional} returned {len(flat_results)} values for "
                                  f"{len(flat_targets)} written tensors)")
    for target, value in zip(flat_targets, flat_results):
        if not isinstance(target, JaxValue):
            raise UnsupportedOp(func, " (it wrote into a tensor that is not a JaxValue)")
        shape = tuple(target.shape)
        if tuple(value.shape) != shape:  # squeeze_, t_, resize_, out= resizing: metadata a JaxValue cannot change
            raise UnsupportedOp(func, f" (it changes a tensor's shape from {shape} to {tuple(value.shape)} in place, "
                                      "which a JaxValue cannot)")
        target.value = value.astype(target.value.dtype)  # a mutation keeps the target's dtype
        _write_back(target, func)
    returns = [by_alias.get(next(iter(r.alias_info.before_set)), None) if r.alias_info else None
               for r in schema.returns]
    if not returns:
        return None
    return returns[0] if len(returns) == 1 else tuple(returns)


def _write_back(view, func):
    """Propagate a view's new value into its base (and its base's base), as torch's aliasing would."""
    from tpudist.ops.lowerings import shape

    while getattr(view, "view_of", None) is not None:
        base, view_op, rest, kw, index = view.view_of
        name = view_op._schema.name.split("::")[1]  # noqa: SLF001
        new, old = view.value, base.value
        if name in ("slice", "slice_copy"):
            updated = shape.slice_scatter(old, new, *rest, **kw)
        elif name in ("select", "select_copy"):
            updated = shape.select_scatter(old, new, *rest, **kw)
        elif name in ("diagonal", "diagonal_copy"):
            updated = shape.diagonal_scatter(old, new, *rest, **kw)
        elif name in ("as_strided", "as_strided_copy"):
            updated = shape.as_strided_scatter(old, new, *rest, **kw)
        elif name in ("view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "alias",
                      "view_copy", "unsqueeze_copy", "squeeze_copy", "alias_copy", "flatten", "unflatten"):
            updated = new.reshape(old.shape)
        elif name in ("permute", "permute_copy"):
            dims = [d % max(old.ndim, 1) for d in rest[0]]
            updated = jnp.transpose(new, np.argsort(dims)) if old.ndim else new
        elif name in ("transpose", "transpose_copy"):
            updated = shape.transpose(new, *rest)
        elif name in ("t", "t_copy"):
            updated = shape.t(new)
        elif name in ("unbind", "unbind_copy"):
            updated = shape.select_scatter(old, new, rest[0] if rest else kw.get("dim", 0), index)
        elif name in ("split", "split_with_sizes", "split_copy", "split_with_sizes_copy"):
            dim = (rest[1] if len(rest) > 1 else kw.get("dim", 0)) % old.ndim
            sizes = rest[0] if name.startswith("split_with_sizes") else [rest[0]] * (old.shape[dim] // rest[0] + 1)
            start = sum(sizes[:index])
            updated = shape.slice_scatter(old, new, dim, start, start + new.shape[dim])
        else:
            raise UnsupportedOp(func, f" (it writes through a view made by {view_op}, which JaxMode cannot write "
                                      "back into its base)")
        base.value = updated.astype(old.dtype)
        view = base


def run_decomposition(decomp, args, kwargs, op=None):
    """Run a torch decomposition on JAX arrays through ``JaxMode``; JAX results back.

    A decomposition that writes into an argument of ``op`` which ``op``'s schema does not declare
    written (torch 2.13's ``native_batch_norm`` updates ``running_mean`` so) raises ``UnsupportedOp``:
    the caller only gets the results back, so the write would be lost.
    """
    args, kwargs = tree_map(_wrap, args), tree_map(_wrap, kwargs)
    inputs = [(x, x.value) for x in _flat([*args, *kwargs.values()]) if isinstance(x, JaxValue)]
    with JaxMode():
        out = decomp(*args, **kwargs)
    if op is not None and not op._schema.is_mutable and any(x.value is not value for x, value in inputs):  # noqa: SLF001
        raise UnsupportedOp(op, " (its decomposition writes into an argument its schema does not declare "
                                "written, and that write would be lost)")
    return tree_map(_unwrap, out)
