"""Device out-of-memory errors: XLA's RESOURCE_EXHAUSTED raised as ``torch.OutOfMemoryError``.

On a TPU, memory runs out where XLA allocates: compiling a program whose buffers do not fit the chip's
HBM ("Ran out of memory in memory space hbm"), running a program (its results and temporaries), and
copying host data to the device. Here that is a Strict op's kernel, a Fused sync (its program), a
``torch.compile`` graph's program on tpu tensors, ``.to("tpu")`` and a read of a view back to the host.
Each of those catches the error where it already handles exceptions, so nothing is paid until one is
raised. ``torch.OutOfMemoryError`` is what ``torch.cuda.OutOfMemoryError`` is (torch 2.13), so code
that catches a CUDA OOM (to halve its batch, say) catches this one.

The state before the failed call is kept: a Strict op writes nothing unless its kernel ran, and a
Fused sync whose program failed puts the storages it wrote back to their values before the graph.
"""

from __future__ import annotations

import jax
import torch

from tpudist.device import _runtime as rt

STATUS = "RESOURCE_EXHAUSTED"  # XLA's status text for an allocation (or a compiled program) that does not fit
_FIX = ("free tensors you no longer need (del them: a tensor's device memory is returned when its last reference "
        "dies), or lower the batch size or sequence length, compute in bfloat16 (torch.autocast('tpu')), "
        "recompute activations (torch.utils.checkpoint), or shard the model over more chips (FSDP); "
        "torch.tpu.memory_allocated() and torch.tpu.memory_stats() show what is held")


# () -> (in_use, free, limit) in bytes: set by ``_module`` (which sits above this module and calls it)
_memory_info = None


def on_memory_info(fn) -> None:
    """Registers how the error reads the device's memory (``torch.tpu``'s functions, in ``_module``)."""
    global _memory_info
    _memory_info = fn


def is_oom(e: BaseException) -> bool:
    return isinstance(e, jax.errors.JaxRuntimeError) and STATUS in str(e)


def raise_if_oom(e: BaseException, what: str, requested: int | None) -> None:
    """Raise ``torch.OutOfMemoryError`` from ``e`` if it is XLA's out-of-memory error, else return.

    ``what`` names the call that failed; ``requested`` is the bytes of its results where known."""
    if is_oom(e):
        raise error(e, what, requested) from e


def error(e: BaseException, what: str, requested: int | None) -> torch.OutOfMemoryError:
    rt.stats["ooms"] += 1
    in_use, free, limit = _memory_info()
    wanted = "" if requested is None else f"requested={_size(requested)} (its results), "
    xla = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    return torch.OutOfMemoryError(
        f"tpu out of memory: {what} needs more device memory than is free: {wanted}in_use={_size(in_use)}, "
        f"free={_size(free)}, limit={_size(limit)} ({_platform()}). XLA: {xla}. To fit: {_FIX}")


def _platform() -> str:
    device = rt.device()
    if device.platform == "tpu":
        return f"{device.device_kind}: JAX's allocator statistics"
    return f"{device.platform} backend: the bytes of live arrays and the host's RAM"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def buffer_bytes(buffers) -> int:
    """The bytes of ``_storage.Buffer``s."""
    return sum(b.numel * b.dtype.itemsize for b in buffers)


def kernel_bytes(kernel) -> int:
    """The bytes of a kernel's results: its fresh outputs and the new values of the storages it writes."""
    fresh = sum(numel * dtype.itemsize for _, dtype, numel, *_ in kernel.outputs or ())
    return fresh + sum(kernel.slots[s][0] * kernel.slots[s][1].itemsize for s in kernel.written_slots)
