"""Autocast on "tpu": ``torch.autocast("tpu", dtype=torch.bfloat16)`` runs matmuls in bf16.

torch 2.13 registers autocast kernels in C++ for CPU/CUDA/XPU/MPS/MTIA/MAIA only, and none at all
for AutocastPrivateUse1 (not even a fallthrough). We register a fallthrough for every op, and for
the ops of torch's CUDA autocast lists (docs: "Autocast Op Reference") a kernel that casts floating
"tpu" tensor arguments to the autocast dtype ("lower precision") or to float32 ("float32" ops), then
calls the op again below autocast. Casts happen above autograd, so gradients flow back in the
parameters' own dtype (fp32 master grads).

``torch.autocast("tpu")`` without a dtype casts to bfloat16, as CPU autocast and TPUs do: torch's
default for a PrivateUse1 backend is float16, kept per thread in C++. ``torch.get_autocast_dtype``
answers bfloat16 for "tpu" in every thread that has not set a dtype itself with
``torch.set_autocast_dtype("tpu", ...)``; a thread that has gets its own choice.
"""

from __future__ import annotations

import functools
import threading

import torch

_LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
)
_FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "softmax.int", "log_softmax.int", "cumsum", "cumprod", "prod", "sum", "cross_entropy_loss",
)
_KEY = torch._C.DispatchKey.AutocastPrivateUse1  # noqa: SLF001
_LIBS: list = []
_DEVICE = "tpu"
_DEFAULT_DTYPE = torch.bfloat16
_chosen = threading.local()  # .tpu is True once this thread set the "tpu" autocast dtype itself
_torch_get_dtype = torch.get_autocast_dtype
_torch_set_dtype = torch.set_autocast_dtype


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """``torch.get_autocast_dtype``, answering bfloat16 for "tpu" until this thread sets a dtype."""
    if device_type == _DEVICE and not getattr(_chosen, "tpu", False):
        return _DEFAULT_DTYPE
    return _torch_get_dtype(device_type)


def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
    """``torch.set_autocast_dtype``, remembering that this thread chose the "tpu" dtype."""
    _torch_set_dtype(device_type, dtype)
    if device_type == _DEVICE:
        _chosen.tpu = True


def _cast(x, dtype):
    if (isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.is_floating_point()
            and x.dtype != torch.float64 and x.dtype != dtype):
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _kernel(op, lower: bool, *args, **kwargs):
    dtype = get_autocast_dtype(_DEVICE) if lower else torch.float32
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):  # noqa: SLF001
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        return op(*args, **kwargs)


def _overloads(name: str) -> list:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return []
    names = [overload] if overload else ["default"]
    return [getattr(packet, n) for n in names if n in packet.overloads()]


def register() -> None:
    # torch.autocast reads the default through torch.get_autocast_dtype, looked up at each call
    torch.get_autocast_dtype = get_autocast_dtype
    torch.set_autocast_dtype = set_autocast_dtype
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    _LIBS.extend([fallthrough, lib])
    for names, lower in ((_LOWER_PRECISION, True), (_FLOAT32, False)):
        for name in names:
            for op in _overloads(name):
                lib.impl(op.name().split("::")[1], functools.partial(_kernel, op, lower), "AutocastPrivateUse1")
