"""``_grouped_mm``: the grouped matmul of mixture-of-experts layers (``torch.nn.functional.grouped_mm``).

Hugging Face transformers routes its MoE experts (Mixtral, Qwen MoE, DeepSeek ...) through it on the
"tpu" device. ``offs`` holds the groups' cumulative end offsets along one dimension, which depends on
the operand ranks (torch's four forms):

- 2-D x 3-D: rows of ``self`` grouped, row ``r`` of group ``g`` times ``mat2[g]`` -> (M, N);
- 3-D x 2-D: columns of ``mat2`` grouped, ``self[g]`` times group ``g``'s columns -> (M, N);
- 2-D x 2-D: the contraction dim grouped, one product per group -> (G, M, N) (the weight gradient
  of the 2-D x 3-D form);
- 3-D x 3-D, no ``offs``: a batched matmul -> (G, M, N).

The offsets are data, not shapes, so one program serves every routing of the tokens. Rows or columns
past the last offset are zero (torch's CPU kernel leaves them unwritten). Products accumulate in
float32 and round once, as torch's CPU kernel does for bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.ops.registry import lowers, lowers_named, shapes_from_lowering

aten = torch.ops.aten


def _group_masks(offs, length):
    """(G, length) booleans: position i belongs to group g when offs[g-1] <= i < offs[g]."""
    ends = offs.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    i = jnp.arange(length, dtype=jnp.int32)
    return (i[None, :] >= starts[:, None]) & (i[None, :] < ends[:, None])


@lowers(aten._grouped_mm.default)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    if bias is not None:
        raise NotImplementedError("_grouped_mm with bias: torch 2.13 supports no bias either ('Bias not "
                                  "supported yet'); add the bias after the product")
    acc = jnp.float32 if a.dtype in (jnp.bfloat16, jnp.float16) else a.dtype
    dot = dict(preferred_element_type=acc)
    if a.ndim == 3 and b.ndim == 3:
        if offs is not None:
            raise ValueError("_grouped_mm of two 3-D tensors takes no offs (each batch entry is its own group)")
        out = jnp.einsum("gmk,gkn->gmn", a, b, **dot)
    elif offs is None:
        raise ValueError(f"_grouped_mm of {a.ndim}-D and {b.ndim}-D tensors needs offs (the groups' end "
                         "offsets along the grouped dimension)")
    elif a.ndim == 2 and b.ndim == 3:
        ends = offs.astype(jnp.int32)
        sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
        out = jax.lax.ragged_dot(a, b, sizes, **dot)
    elif a.ndim == 3 and b.ndim == 2:
        mask = _group_masks(offs, b.shape[1])
        out = jnp.einsum("gmn,gn->mn", jnp.einsum("gmk,kn->gmn", a, b, **dot), mask.astype(acc))
    elif a.ndim == 2 and b.ndim == 2:
        # each group's slice of the contraction, zeros elsewhere: in the operands' dtype, so a bf16 product
        # stays one MXU pass on TPU at every float32 matmul precision (tpudist.matmul_precision)
        masked = jnp.where(_group_masks(offs, a.shape[1])[:, None, :], a[None], jnp.zeros((), a.dtype))
        out = jnp.einsum("gmk,kn->gmn", masked, b, **dot)
    else:
        raise ValueError(f"_grouped_mm takes 2-D or 3-D operands, got {a.ndim}-D and {b.ndim}-D")
    return out.astype(a.dtype if out_dtype is None else out_dtype)


# torch's meta kernel checks CUDA's rule (bf16 operands only); its CPU kernel, like this lowering, takes
# float32 too, and Hugging Face calls it on "tpu" tensors of any dtype
shapes_from_lowering(aten._grouped_mm.default)


def _meta_for_any_float():
    """Let torch's meta kernel of ``_grouped_mm`` (which FakeTensor runs when Dynamo traces a model on
    "tpu" tensors) take float32/float16 operands as its CPU kernel does: the same shape checks, run on
    bf16 stand-ins, and the result in the operands' dtype. Other dtypes keep its error."""
    from torch._C import DispatchKey
    from torch._decomp import meta_table

    op = aten._grouped_mm.default
    strict = op.py_kernels.get(DispatchKey.Meta)
    if strict is None or getattr(strict, "any_float", False):
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype != mat_b.dtype or mat_a.dtype not in (torch.float32, torch.float16):
            return strict(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        out = strict(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), offs=offs, bias=bias, out_dtype=out_dtype)
        return out if out_dtype is not None else out.to(mat_a.dtype)

    meta.any_float = True
    op.py_kernels[DispatchKey.Meta] = meta
    if op in meta_table:
        meta_table[op] = meta
    op._dispatch_cache.clear()  # noqa: SLF001


_meta_for_any_float()


# Hugging Face's own stand-in for the grouped matmul (transformers/integrations/moe.py), an opaque custom
# op it calls under torch.compile when the weights are not bf16: the 2-D x 3-D form, and its backward


@lowers_named("transformers::grouped_mm_fallback")
def transformers_grouped_mm(x, weight, offs):
    return grouped_mm(x, weight, offs)


@lowers_named("transformers::grouped_mm_fallback_backward")
def transformers_grouped_mm_backward(x, weight, offs, grad_out):
    """(grad_input, grad_weight): the backward's two products are grouped matmuls themselves."""
    grad_x = grouped_mm(grad_out, jnp.swapaxes(weight, -1, -2), offs)
    grad_w = grouped_mm(jnp.swapaxes(x, 0, 1), grad_out, offs)
    return grad_x, grad_w
