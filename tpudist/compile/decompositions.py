"""The Core ATen graphs the backend compiles: torch's decompositions, corrected where they give wrong
values; attention as eager torch runs it (the fused op), or through its math backend.

``backend`` traces with them through AOTAutograd, and the padding analysis
(``_pad_analysis.trace_aten``) traces the same graph symbolically with them.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.fx


_FUSED_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@contextlib.contextmanager
def math_sdpa():
    # the math backend decomposes attention into matmuls and softmax, which the table lowers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _sdpa_dropout(gm: torch.fx.GraphModule) -> bool:
    """Whether an attention call of ``gm`` may drop out (a dropout_p that is not the constant 0)."""
    sdpa = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)  # noqa: SLF001
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in sdpa:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if not isinstance(p, (int, float)) or p != 0:
                return True
    return False


@contextlib.contextmanager
def attention_as_eager(gm: torch.fx.GraphModule):
    """Attention in the graphs traced inside as eager torch runs it: the fused attention op and its
    backward (CPU tensors take torch's CPU flash kernel, tpu tensors the device's fused op), lowered
    as the device lowers them (on a TPU chip the Pallas flash kernels where they fit); the math
    decomposition upcast bf16 attention to float32, six-pass products on the chip. A graph whose
    attention drops out goes through the math backend (the fused backward cannot replay a dropout
    mask). Pair it with ``decompositions(fused_attention=True)``."""
    if _sdpa_dropout(gm):
        with math_sdpa():
            yield
        return
    attention = sys.modules.get("tpudist.device._attention")  # loaded with the device, if at all
    with attention.fused_in_compile_traces() if attention is not None else contextlib.nullcontext():
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


def _nll_loss_backward(grad_output, x, target, weight, reduction: int, ignore_index: int, total_weight):
    """``aten.nll_loss_backward`` (and ``nll_loss2d_backward``) as torch 2.13's decomposition computes it,
    with the scatter of -1 into zeros replaced by a comparison of the class index with the target.

    The scatter cost twice on the chip: XLA:TPU lowers it as a flat (rows x classes) broadcast and
    scatter and a relayout back (5.6 ms of a 94.5 ms step on the v5e for 8192 x 32000 logits), and as an
    op that reads the log-softmax output (for its shape) it made AOTAutograd's partitioner keep that
    float32 output for the backward. The comparison is elementwise: XLA fuses it into the log-softmax
    backward, and the partitioner may recompute the log-softmax from its (bfloat16) input."""
    channel_dim = 0 if x.dim() < 2 else 1
    if reduction == 1:  # mean
        grad_output = grad_output / total_weight
    target = target.unsqueeze(channel_dim)
    kept = target != ignore_index
    along_classes = [-1 if d == channel_dim else 1 for d in range(x.dim())]  # a shape that broadcasts
    classes = torch.arange(x.shape[channel_dim], device=target.device).reshape(along_classes)
    grad_input = torch.where(classes == target, -1.0, 0.0).to(x.dtype)  # ignored rows are zeroed below
    if grad_input.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        grad_input = grad_input * weight.reshape(along_classes)
    grad_input = torch.where(kept, grad_input, 0)
    return grad_input * grad_output


def _nll_loss_forward(x, target, weight, reduction: int, ignore_index: int):
    """``aten.nll_loss_forward`` (and ``nll_loss2d_forward``) as torch 2.13's decomposition computes it,
    with the gather of each row's target value replaced by a sum over the classes of the input where the
    class is the target, 0 elsewhere: one value and zeros, so the same number (a -0.0 target value aside,
    which comes out +0.0).

    A gather reads its input materialized: behind the cross-entropy's log-softmax that is the float32
    log-probabilities, as large as the logits (on the TPU v5e, for 8192 x 32000 logits, a 1 GiB write
    of 2.35 ms a step that only the gather read). A masked sum is a reduction XLA fuses with the
    log-softmax's subtraction, which then never leaves the chip's vector registers."""
    channel_dim = 0 if x.dim() < 2 else 1
    along_classes = [-1 if d == channel_dim else 1 for d in range(x.dim())]
    if weight is not None:
        x = x * weight.reshape(along_classes)
    kept = target != ignore_index
    safe_target = torch.where(kept, target, 0)
    classes = torch.arange(x.shape[channel_dim], device=target.device).reshape(along_classes)
    picked = torch.where(classes == safe_target.unsqueeze(channel_dim), x, 0).sum(channel_dim)
    result = torch.where(kept, -picked, 0)
    if reduction == 0 and x.dim() > 1:
        return result, x.new_full((), 0.0)
    if weight is not None:
        total_weight = torch.where(kept, weight[safe_target.reshape(-1)].reshape(target.shape), 0).sum()
    else:
        total_weight = kept.sum().to(x)
    if reduction == 2:
        result = result.sum()
    elif reduction == 1:
        result = result.sum() / total_weight
    return result, total_weight


def _memory_decompositions() -> dict:
    """Decompositions chosen for what crosses to the backward and for the chip's memory traffic.
    ``_log_softmax`` whole is one op whose float32 result (as large as the logits) the backward must
    read; decomposed into a max, a log-sum-exp and a subtraction, AOTAutograd's partitioner may save the
    row statistics and the input (bfloat16 logits before their upcast) instead and recompute the
    subtraction in the backward. ``_nll_loss_backward`` above replaces torch's scatter, and
    ``_nll_loss_forward`` its gather, which would read the log-probabilities materialized."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    return {**get_decompositions([aten._log_softmax.default]),
            aten.nll_loss_backward.default: _nll_loss_backward, aten.nll_loss2d_backward.default: _nll_loss_backward,
            aten.nll_loss_forward.default: _nll_loss_forward, aten.nll_loss2d_forward.default: _nll_loss_forward}


# ops the table lowers as torch's CPU kernel computes them, which their decomposition does not:
# torch.logspace decomposes to pow(base, linspace(start, end) in float64), not its kernel's exponents
# (start and end cast to the dtype first), and a float64 pow on the chip is not glibc's
_LOWERED_WHOLE = (torch.ops.aten.logspace.default,)


@functools.cache
def decompositions(fused_attention: bool = False) -> dict:
    """Core ATen's decompositions with the corrections; ``fused_attention`` keeps the fused attention
    op whole (the table lowers it and its backward)."""
    from torch._decomp import core_aten_decompositions

    table = {**core_aten_decompositions(), **_corrections(), **_memory_decompositions()}
    for op in _LOWERED_WHOLE:
        table.pop(op, None)
    if fused_attention:
        table.pop(_FUSED_ATTENTION, None)
    return table
