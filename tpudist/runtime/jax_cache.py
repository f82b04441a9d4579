"""Where tpudist's caches live, and JAX's persistent compilation cache, on by default.

One root, ``$TPUDIST_CACHE_DIR`` (default ``~/.cache/tpudist``, ``$XDG_CACHE_HOME`` honoured): a
path, or with ``fsspec`` installed any fsspec URL, which every host of a pod may share.
``TPUDIST_CACHE_DIR=0`` turns every cache off. In it:

- ``programs/``: tpudist's program cache (``tpudist.runtime.program_cache``): traced programs as
  ``jax.export`` modules and the XLA executables of collectives, compiled graphs, the device's Fused
  programs and host reads, and DTensor redistribute/SPMD programs, shared by every process and host
  that would build the same program (a single-device executable names no device: any rank loads it).
- the files of JAX's persistent compilation cache (the other XLA executables, e.g. Strict-mode
  kernels; on multi-process CPU only process 0 writes them; JAX only touches its
  own ``*-cache`` and ``*-atime`` files). JAX reads and writes local or mounted paths only: for a
  URL root they go to the local default root instead. Every program is cached, however fast it
  compiled (JAX's default skips those under 1 s). It is enabled at the device's first use, when a
  "tpu" process group hands the device its chip, by compiled graphs and by kernels.
"""

from __future__ import annotations

import os
from pathlib import Path

from tpudist.runtime._cache_settings import cache_root, local_default, max_bytes_from_env

_enabled: str | None = None


def cache_dir() -> Path | None:
    """The directory JAX's persistent compilation cache uses, or None when ``TPUDIST_CACHE_DIR=0``."""
    root = cache_root()
    if root is None:
        return None
    if "://" in root:
        return Path(root[len("file://"):]) if root.startswith("file://") else local_default()
    return Path(root)


def enable_persistent_cache() -> Path | None:
    """Point JAX's compilation cache at ``cache_dir()`` (once per process); returns the directory.

    Leaves a cache directory the user configured for JAX themselves alone. ``TPUDIST_CACHE_MAX_BYTES``
    bounds it too where JAX can enforce a bound (it needs the ``filelock`` package).
    """
    global _enabled
    path = cache_dir()
    if path is None:
        return None
    if _enabled is not None:
        return Path(_enabled)
    import importlib.util

    import jax

    if jax.config.jax_compilation_cache_dir:
        _enabled = jax.config.jax_compilation_cache_dir
        return Path(_enabled)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if os.environ.get("TPUDIST_CACHE_MAX_BYTES") and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", max_bytes_from_env())
    _enabled = str(path)
    return path
