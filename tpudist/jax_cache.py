"""JAX's persistent compilation cache, on by default for tpudist's programs.

The device's eager programs, the compile backend's graphs and the kernels all compile through XLA;
a second process on the same machine (another emulated rank, the next run) reads what the first
compiled from disk. One directory per user, ``$TPUDIST_CACHE_DIR`` or
``~/.cache/tpudist/jax`` (``$XDG_CACHE_HOME`` honoured); ``TPUDIST_CACHE_DIR=0`` turns it off.
Every program is cached, however fast it compiled (JAX's default skips those under 1 s).
"""

from __future__ import annotations

import os
from pathlib import Path

_enabled: str | None = None


def cache_dir() -> Path | None:
    """The directory the persistent cache uses, or None when ``TPUDIST_CACHE_DIR=0``."""
    value = os.environ.get("TPUDIST_CACHE_DIR")
    if value == "0":
        return None
    if value:
        return Path(value).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tpudist" / "jax"


def enable_persistent_cache() -> Path | None:
    """Point JAX's compilation cache at ``cache_dir()`` (once per process); returns the directory.

    Leaves a cache directory the user configured for JAX themselves alone.
    """
    global _enabled
    path = cache_dir()
    if path is None:
        return None
    if _enabled is not None:
        return Path(_enabled)
    import jax

    if jax.config.jax_compilation_cache_dir:
        _enabled = jax.config.jax_compilation_cache_dir
        return Path(_enabled)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = str(path)
    return path
