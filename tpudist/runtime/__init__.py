"""The process-wide runtime under every other layer: what one process keeps for its whole life,
whichever layer started it.

- :mod:`tpudist.runtime.program_cache`: one cache of traced programs (``jax.export`` modules) and XLA
  executables, shared by every process and host that would build the same program;
- :mod:`tpudist.runtime.jax_cache`: where the caches live, and JAX's persistent compilation cache;
  ``_cache_settings`` (root and size bound, read by both) and ``_cache_storage`` (a local folder or
  an fsspec filesystem) are this package's own;
- :mod:`tpudist.runtime.chip`: the chip this process drives while a "tpu" world runs (the process
  group writes it at boot and teardown, the device reads it).

JAX's multi-process start-up itself stays with the process group (``tpudist.process_group.runtime``),
the one layer that starts a world; it records the chip here for the layers below it.
"""
