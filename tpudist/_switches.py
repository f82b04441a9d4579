"""On/off switches read from the environment (``TPUDIST_*=0|1``): one reader, one error for a bad value."""

from __future__ import annotations

import os


def switch(name: str, default: str, on: str, off: str) -> bool:
    """Whether ``name`` (unset: ``default``) is "1"; any value but "0" or "1" raises, saying what each means."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} must be '1' ({on}) or '0' ({off})")
    return value == "1"
