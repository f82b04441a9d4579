"""The Core ATen graphs the backend compiles: torch's decompositions, corrected where they give wrong
values, with attention traced through its math backend.

``backend`` traces with them through AOTAutograd, and the padding analysis
(``_pad_analysis.trace_aten``) traces the same graph symbolically with them.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def math_sdpa():
    # Core ATen decompositions leave the CPU flash-attention backward in the graph (FACTS.md); the
    # math backend decomposes attention into matmuls and softmax, which the table lowers.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _multilabel_margin_loss_forward(x, target, reduction: int):
    """``aten.multilabel_margin_loss_forward`` in ops AOTAutograd differentiates, with the fix below.

    torch 2.13's decomposition (torch/_decomp/decompositions.py) adds the hinge terms of the target
    slots after a row's -1 terminator as if they held class 0: ``F.multilabel_margin_loss(x, [[1, 3,
    -1, 0, 0]])`` came out 1.60 where torch's kernel gives 1.00, forward and gradients, on CPU and
    device tensors alike. It is the op's Python kernel at the Autograd key, which AOTAutograd's tracing
    runs before any decomposition table, so ``corrected_decompositions`` swaps this one in."""
    rows, target2 = torch.atleast_2d(x), torch.atleast_2d(target)
    num_classes = rows.shape[-1]
    classes = torch.arange(num_classes, device=target.device)
    end = torch.amin(torch.where(target2 == -1, classes, num_classes), dim=-1, keepdim=True)
    is_slot = classes < end  # (rows, slots): the slots before the row's first -1 hold targets
    slot_score = torch.gather(rows, -1, torch.where(is_slot, target2, 0))
    is_target = (classes == torch.where(is_slot, target2, -1).unsqueeze(-1)).any(dim=1)  # (rows, classes)
    hinge = (1.0 - slot_score.unsqueeze(-1) + rows.unsqueeze(1)).clamp_min(0) / num_classes
    hinge = torch.where(is_slot.unsqueeze(-1) & ~is_target.unsqueeze(1), hinge, 0)
    loss = hinge.sum(dim=(1, 2))
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2:
        loss = loss.sum()
    else:
        loss = loss.reshape(x.shape[:-1])
    return loss, is_target.to(x.dtype).reshape(target.shape)


def _corrections() -> dict:
    """op -> a correct decomposition, for ops whose torch decomposition gives wrong values."""
    return {torch.ops.aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward}


@contextlib.contextmanager
def corrected_decompositions():
    from torch._C import DispatchKey

    previous = {}
    for op, decomposition in _corrections().items():
        previous[op] = op.py_kernels.get(DispatchKey.Autograd)
        op.py_kernels[DispatchKey.Autograd] = decomposition
        op._dispatch_cache.clear()  # noqa: SLF001 - as OpOverload.py_impl does when it registers
    try:
        yield
    finally:
        for op, kernel in previous.items():
            if kernel is None:
                op.py_kernels.pop(DispatchKey.Autograd, None)
            else:
                op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()  # noqa: SLF001


@functools.cache
def decompositions() -> dict:
    from torch._decomp import core_aten_decompositions

    return {**core_aten_decompositions(), **_corrections()}
