"""On/off switches read from the environment (``TPUDIST_*=0|1``): one reader, one error for a bad value."""

from __future__ import annotations

import os


def switch(name: str, default: str, on: str, off: str) -> bool:
    """Whether ``name`` (unset: ``default``) is "1"; any value but "0" or "1" raises, saying what each means."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} must be '1' ({on}) or '0' ({off})")
    return value == "1"


def shaped_storage() -> bool:
    """``TPUDIST_SHAPED_STORAGE`` (unset: 0): whether a whole storage's N-d values stay N-d between
    programs (``Shaped``): copied to the device so (``.to("tpu")``), left so by Fused programs and by
    compiled ones, and read so by compiled programs. On a TPU a flat array and an N-d one have
    different tiled layouts, so each reshape between them is a copy of the tensor: parameters read
    flat by every forward and backward, gradients left flat by every backward. Strict kernels still
    read storages flat (``concrete``). Off by default until measured on a chip."""
    return switch("TPUDIST_SHAPED_STORAGE", "0", "N-d storages stay N-d between programs",
                  "programs read and leave storages flat, the default")
