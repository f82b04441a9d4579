"""Debug mode's checks: indices XLA would clamp silently, arguments it would draw from silently, NaNs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from tpudist.device._storage import is_tpu, value_of

aten = torch.ops.aten


def check_nans(op, outs):
    for o in outs:
        if jnp.issubdtype(o.dtype, jnp.inexact) and bool(jnp.isnan(o).any()):
            raise FloatingPointError(f"{op} produced NaN on the tpu device (debug mode NaN check; turn it "
                                     "off with torch.tpu.set_nan_check(False))")


def _index_checks(op, args, kwargs):
    """(index tensor, size it indexes, dim, negatives allowed) for ops whose indices XLA would clamp."""
    kw = lambda name, pos: kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)  # noqa: E731
    if op is aten.embedding.default:
        return [(args[1], args[0].shape[0], 0, False)]
    if op in (aten.index_select.default, aten.gather.default, aten.scatter.src, aten.scatter.value,
              aten.scatter_add.default, aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default,
              aten.index_add.default, aten.index_add_.default, aten.index_copy.default, aten.index_copy_.default,
              aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar):
        dim = kw("dim", 1)
        source = args[0]
        size = source.shape[dim] if source.dim() else 1
        return [(kw("index", 2), size, dim, True)]
    if op in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        checks = []
        for dim, index in enumerate(kw("indices", 1) or ()):
            if index is not None and not (index.dtype == torch.bool or index.dtype == torch.uint8):
                checks.append((index, args[0].shape[dim], dim, True))
        return checks
    return ()


def check_arguments(op, args, kwargs):
    """Debug mode: the data-dependent checks torch's kernels make and XLA's programs do not, on the host."""
    check_indices(op, args, kwargs)
    if op is aten.poisson.default and is_tpu(args[0]) and args[0].numel():
        rates = np.asarray(value_of(args[0]), np.float64)
        if not (rates >= 0).all():  # NaN too, as torch's CPU kernel
            raise RuntimeError("invalid Poisson rate, expected rate to be non-negative (torch's check; debug mode "
                               f"makes it, strict and fused modes draw -1 there): found {rates[~(rates >= 0)][0]}")


def check_indices(op, args, kwargs):
    """Debug mode: JAX clamps (or drops) out-of-range indices silently; torch raises. Check on the host."""
    for index, size, dim, negatives in _index_checks(op, args, kwargs):
        if not isinstance(index, torch.Tensor) or index.numel() == 0:
            continue
        values = np.asarray(value_of(index)) if is_tpu(index) else index.numpy()
        low = -size if negatives else 0
        if values.min() < low or values.max() >= size:
            bad = values.max() if values.max() >= size else values.min()
            raise IndexError(f"{op}: index {int(bad)} is out of range for dimension {dim} of size {size} "
                             "(torch: index out of range in self; debug mode checks the indices XLA would "
                             "clamp silently in strict and fused modes)")
