"""The "tpu" c10d backend: every torch.distributed collective as an XLA collective.

Registered automatically on ``import torch`` (a ``torch.backends`` entry point), so user code only
calls ``torch.distributed.init_process_group("tpu")``. Importing this package does not import JAX.

Inside: ``group`` is the c10d class torch calls, whose methods are the host path (its
``DEVICE_PATHS`` sends a call on tpu tensors to ``device_collectives``); each group's ``channel``
(store, timeout, members, ``run_program``, ``submit``) is what the helpers take (``movement``,
``device_collectives``, ``p2p``, ``small``, ``sparse``, ``debug``, ``monitor``); ``keys``
(``ProgramKey``) <- ``envelope``, ``lowerings`` <- ``programs`` build and cache the XLA programs.
"""

from tpudist.process_group._autoload import ALIAS_NAME, BACKEND_NAME, register


def __getattr__(name):  # keep `import tpudist` free of JAX: load the backend on first use
    if name in ("ProcessGroupTPU", "create_process_group"):
        from tpudist.process_group import group

        return getattr(group, name)
    if name in ("CollectiveError", "CollectiveTimeout", "Work"):
        from tpudist.process_group import work

        return getattr(work, name)
    if name == "topology":
        from tpudist.process_group.runtime import current

        return lambda: current().topology
    if name == "cache_stats":
        from tpudist.process_group.programs import cache_stats

        return cache_stats
    if name == "monitored_barrier":
        from tpudist.process_group.monitor import monitored_barrier

        return monitored_barrier
    if name == "split_group":
        from tpudist.process_group.split import split_group

        return split_group
    raise AttributeError(name)


__all__ = ["ALIAS_NAME", "BACKEND_NAME", "CollectiveError", "CollectiveTimeout", "ProcessGroupTPU",
           "cache_stats", "create_process_group", "topology", "monitored_barrier", "register",
           "split_group"]
