"""The two settings every tpudist cache reads: where the caches live and how large they may grow.

``TPUDIST_CACHE_DIR`` is the root (default ``~/.cache/tpudist``, ``$XDG_CACHE_HOME`` honoured; a
path or an fsspec URL; ``0`` turns every cache off) and ``TPUDIST_CACHE_MAX_BYTES`` the size bound
(default 8 GiB). ``tpudist.runtime.program_cache`` and ``tpudist.runtime.jax_cache`` both read them, so they live
here, below both.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MAX_BYTES = 8 * 2**30


def local_default() -> Path:
    """The root used when ``TPUDIST_CACHE_DIR`` is unset: ``$XDG_CACHE_HOME/tpudist`` or ``~/.cache/tpudist``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpudist"


def cache_root() -> str | None:
    """The root of tpudist's caches (a path or a URL), or None when ``TPUDIST_CACHE_DIR=0``."""
    value = os.environ.get("TPUDIST_CACHE_DIR")
    if value == "0":
        return None
    if value:
        return value if "://" in value else str(Path(value).expanduser())
    return str(local_default())


def parse_bytes(text: str) -> int:
    """``"8G"`` -> 8 * 2**30; plain integers are bytes."""
    text = text.strip()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"TPUDIST_CACHE_MAX_BYTES={text!r} is not a size: write bytes or a number with "
                         "K, M, G or T (e.g. 8G)") from None
    if value <= 0:
        raise ValueError(f"TPUDIST_CACHE_MAX_BYTES={text!r} must be positive; TPUDIST_CACHE_DIR=0 turns caching off")
    return value


def max_bytes_from_env() -> int:
    """The size bound ``TPUDIST_CACHE_MAX_BYTES`` sets (default 8 GiB)."""
    value = os.environ.get("TPUDIST_CACHE_MAX_BYTES")
    return DEFAULT_MAX_BYTES if not value else parse_bytes(value)
