""""tpu" device tensors at a compiled graph's edge: no crossing at all.

A tpu tensor's storage holds a flat ``jax.Array`` (``tpudist.device``). A program compiled for
device inputs takes each input flat and returns each output flat, so a tensor that covers its whole
storage enters as the storage's array itself and every result becomes a new tpu tensor over the
program's output buffer, with no copy and no extra dispatch. Other views are read out first.
"""

from __future__ import annotations

import math

import torch


def is_device_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu"


def jax_device():
    from tpudist.device import _runtime

    return _runtime.device()


def flat_value(t: torch.Tensor):
    """The tensor's values as a flat jax.Array (its storage's own array when it covers it all)."""
    from tpudist.device import _core

    buf = _core.buffer_of(t)
    if isinstance(buf.value, _core.Lazy):
        _core.flush()
    value = buf.value
    numel = math.prod(t.shape)
    if (value is not None and t.is_contiguous() and t.storage_offset() == 0 and buf.numel == numel
            and buf.dtype == t.dtype and value.shape == (numel,)):
        return value
    return _core.value_of(t).reshape(-1)


def flat_input(t: torch.Tensor, device):
    """A program input as a flat jax.Array on ``device``: a device tensor's values, or a copy of a
    CPU tensor's. Graphs on device tensors take CPU ones too, as torch's ops do: an optimizer's
    ``step`` counts are CPU scalars beside the device parameters, and ``batch.to("tpu")`` inside the
    compiled function is a CPU input moved in the graph. A copy: the program runs asynchronously,
    and the CPU tensor may be updated in place (a step count is) before XLA would read it."""
    if is_device_tensor(t):
        return flat_value(t)
    import jax
    import numpy as np

    from tpudist._hostmem import numpy_view

    return jax.device_put(np.array(numpy_view(t.detach())[0]).reshape(-1), device)


def raise_if_oom(e: BaseException, what: str, requested: int) -> None:
    """XLA's out-of-memory error of a device program as ``torch.OutOfMemoryError`` (as eager ops raise it)."""
    from tpudist.device import _oom

    _oom.raise_if_oom(e, what, requested)


def new_tensor(flat, shape, dtype: torch.dtype, host: bool = False) -> torch.Tensor:
    """A device tensor over ``flat`` (no copy); ``host``: a CPU tensor (an output on the CPU: a step
    count's new value)."""
    from tpudist.device import _core

    out = _core.new_tensor(tuple(shape), dtype, value=flat)
    return _core.to_cpu(out) if host else out
