""""tpu" device tensors at a compiled graph's edge: no crossing at all.

A tpu tensor's storage holds a flat ``jax.Array`` (``tpudist.device``). A program compiled for
device inputs takes each input flat and returns each output flat, so a tensor that covers its whole
storage enters as the storage's array itself and every result becomes a new tpu tensor over the
program's output buffer, with no copy and no extra dispatch. Other views are read out first.

The activations a forward saves for its backward are the exception: the forward returns them in
their own shape (a ``Shaped`` storage value) and the backward takes them so. On a TPU a reshape
between a flat array and an N-d one is a copy of the whole tensor (their tiled layouts differ): flat
saved activations cost two such copies each, every step.
"""

from __future__ import annotations

import math

import torch


def is_device_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu"


def jax_device():
    from tpudist.device import interop

    return interop.device()


def device_value(t: torch.Tensor, shaped: bool):
    """The tensor's values as a jax.Array, of its own shape (``shaped``) or flat: its storage's own
    array where the tensor covers it all and the array has that form already."""
    from tpudist.device import interop

    buf = interop.buffer_of(t)
    if buf.value.__class__ is interop.Lazy:
        interop.flush()
    value, shape = buf.value, tuple(t.shape)
    if value is not None and interop.is_whole(t, buf):
        array = value.array if value.__class__ is interop.Shaped else value
        if array.shape == (shape if shaped else (math.prod(shape),)):
            return array
    value = interop.value_of(t)
    return value if shaped else value.reshape(-1)


def program_input(t: torch.Tensor, device, shaped: bool = False):
    """A program input on ``device``, flat or of the tensor's shape (``shaped``): a device tensor's values,
    or a copy of a CPU tensor's. Graphs on device tensors take CPU ones too, as torch's ops do: an
    optimizer's ``step`` counts are CPU scalars beside the device parameters, and ``batch.to("tpu")``
    inside the compiled function is a CPU input moved in the graph. A copy: the program runs
    asynchronously, and the CPU tensor may be updated in place (a step count is) before XLA would read it."""
    if is_device_tensor(t):
        return device_value(t, shaped)
    import jax
    import numpy as np

    from tpudist.bridge import numpy_view

    host = np.array(numpy_view(t.detach())[0])
    return jax.device_put(host if shaped else host.reshape(-1), device)


def raise_if_oom(e: BaseException, what: str, requested: int) -> None:
    """XLA's out-of-memory error of a device program as ``torch.OutOfMemoryError`` (as eager ops raise it)."""
    from tpudist.device import interop

    interop.raise_if_oom(e, what, requested)


def new_tensors(specs: tuple, arrays: list) -> list[torch.Tensor]:
    """``new_tensor`` of each of ``arrays`` on the device, in one call (C++ where it built): ``specs`` holds
    each one's (shape, dtype, numel[, dense strides]). Per result this costs a few microseconds less than
    ``new_tensor``: a forward returns a hundred saved activations or more."""
    from tpudist.device import interop

    shaped = interop.Shaped
    return interop.outputs(specs, [a if a.ndim == 1 else shaped(a) for a in arrays], None, 0, None)


def new_tensor(array, shape, dtype: torch.dtype, host: bool = False, strides=None) -> torch.Tensor:
    """A device tensor over ``array`` (no copy), flat or of ``shape`` (then a ``Shaped`` storage value);
    of the dense ``strides`` where given (then ``array`` is flat, in their physical order); ``host``: a CPU
    tensor (an output on the CPU: a step count's new value)."""
    from tpudist.device import interop

    shape = tuple(shape)
    value = array if array.ndim == 1 else interop.Shaped(array)  # 1-d: flat and shaped are the same
    out = interop.new_tensor(shape, dtype, value=value, strides=strides)
    return interop.to_cpu(out, strides) if host else out
