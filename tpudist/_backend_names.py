"""The names tpudist's c10d backend goes by: "tpu", or "tpudist" where another package owns "tpu".

``tpudist.process_group._autoload`` registers them (the ``torch.backends`` entry point); the device's
accelerate integration (``tpudist.device._accelerate``), a layer below the process group, asks which
one this process uses. Cheap to import: torch calls the entry point on every ``import torch``.
"""

from __future__ import annotations

BACKEND_NAME = "tpu"
ALIAS_NAME = "tpudist"  # always ours, for when another package already owns "tpu"


def plugin(name: str):
    """torch's registration of the c10d backend ``name``, or None."""
    import torch.distributed as dist

    return dist.Backend._plugins.get(name.upper())  # noqa: SLF001 - torch keeps no public map


def is_ours(registered) -> bool:
    return getattr(registered.creator_fn, "tpudist", False)  # _autoload marks its creator so


def our_backend_name() -> str:
    """The c10d name of tpudist's backend in this process: "tpu", or "tpudist" when another package owns "tpu"."""
    registered = plugin(BACKEND_NAME)
    return BACKEND_NAME if registered is not None and is_ours(registered) else ALIAS_NAME
