"""The strides of an op's results: torch's meta kernel's, corrected where the CPU/CUDA kernels differ.

A fresh device tensor takes the strides torch's meta kernel gives it (a pointwise op on a
channels_last input is channels_last, ``clone(memory_format=...)`` and ``_to_copy`` keep or set the
format), so ``.stride()``, ``.is_contiguous(memory_format=...)`` and the views that depend on them
(``x.permute(0, 2, 3, 1).view(-1, C)``) behave as on the CPU. Its storage holds the value in that
physical order (``views.permuted_order``).

A few meta kernels answer contiguous where the real kernels keep the input's memory format (measured
on torch 2.13 against CPU strides, forward and backward of conv/batchnorm/pooling/upsampling/norm
layers in channels_last and channels_last_3d): ``convolution`` (CPU's mkldnn and thnn and CUDA's
cudnn paths pick channels_last when the input or the weight suggests it: ATen's
``_determine_backend_memory_format``) and ``native_batch_norm_backward`` (CPU's grad_input follows
the input's suggested format, the meta kernel follows grad_out). ``_KEEP_FORMAT`` says which
arguments decide for these ops.
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from tpudist.device import views

aten = torch.ops.aten

# op -> the positions of the arguments whose suggested memory format its results of rank 4 (5) take
# (the first that is not contiguous_format wins)
_KEEP_FORMAT = {
    aten.convolution.default: (0, 1),                 # input, weight
    aten.native_batch_norm_backward.default: (1,),    # input
    # shapes_from_lowering ops (tpudist/ops/lowerings/nn.py: their meta kernels' dtypes are CUDA's), so
    # no meta strides either; CPU's batch_norm_cpu makes its output empty_like(input, suggested format)
    **{op: (0,) for op in (
        aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit_no_training.default,
        aten._batch_norm_with_update.default, aten._batch_norm_with_update_functional.default,
        aten._batch_norm_no_update.default)},
}

_RANK_OF = {torch.channels_last: 4, torch.channels_last_3d: 5}


def result_strides(op, args, shapes, strides) -> list:
    """The strides of ``op``'s results, called on ``args`` (meta tensors where the call had device
    tensors), given their ``shapes`` and the ``strides`` the meta kernel gave them (None where it did
    not run: contiguous): those, or the memory format the real kernels keep (``_KEEP_FORMAT``)."""
    positions = _KEEP_FORMAT.get(op)
    if positions is None:
        return strides
    for i in positions:
        x = args[i] if i < len(args) else None
        if isinstance(x, torch.Tensor):
            fmt = suggest_memory_format(x)
            if fmt in _RANK_OF:
                return [format_strides(shape, fmt) if len(shape) == _RANK_OF[fmt] else s
                        for shape, s in zip(shapes, strides)]
    return strides


def format_strides(shape, memory_format: torch.memory_format) -> tuple[int, ...]:
    """The strides torch gives a new tensor of ``shape`` in ``memory_format`` (``torch.empty``'s)."""
    return tuple(torch.empty(tuple(shape), device="meta", memory_format=memory_format).stride())


def copy_strides(x: torch.Tensor, memory_format=None) -> tuple[int, ...]:
    """The strides of ``x.to(device, memory_format=...)`` across devices: torch's ``_to_copy`` rule
    (ATen TensorConversions.cpp): ``preserve`` keeps a dense tensor's strides and gives any other the
    format it suggests; an explicit format is that format's."""
    if memory_format is None or memory_format == torch.preserve_format:
        if views.permuted_order(x.shape, x.stride()) is not None:  # non-overlapping and dense
            return tuple(x.stride())
        memory_format = suggest_memory_format(x)
    return format_strides(x.shape, memory_format)
