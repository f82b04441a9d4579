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


def new_tensor(flat, shape, dtype: torch.dtype) -> torch.Tensor:
    from tpudist.device import _core

    return _core.new_tensor(tuple(shape), dtype, value=flat)
