"""The chip this process drives in a running "tpu" world, for the layers below the process group.

``tpudist.process_group.runtime`` boots JAX's distributed runtime for a world and tears it down; while
the world runs it records this process's JAX device here (None otherwise, and after an abort). The
"tpu" device (``tpudist.device``), a layer below the process group, drives that same chip and reads it
here.
"""

from __future__ import annotations

from typing import Any

_local_device: Any = None


def local_device() -> Any:
    """This process's JAX device in the running world, or None while no world runs."""
    return _local_device


def set_local_device(device: Any) -> None:
    """Called by the process group's runtime only: at boot, at teardown and when a world is abandoned."""
    global _local_device
    _local_device = device
