"""tpudist: unmodified PyTorch distributed training on TPU pods, and on CPU processes emulating them.

    import torch.distributed as dist
    dist.init_process_group("tpu")   # every c10d collective becomes an XLA collective

Layers (imports flow downwards only): ``tpudist.mesh`` (the ICI torus as data: no torch, no JAX),
``tpudist.process_group`` (the c10d backend), ``tpudist.sharding`` (DTensor <-> JAX).
"""

from tpudist._version import __version__
from tpudist.kernels.helion_route import route_helion_with_the_device

# `import tpudist.device` (the opt-in) then routes plain @helion.kernel calls on tpu tensors through tpudist
# once Helion is imported (no host round trip). Wired here, the top layer, above the device and the kernels
# both: this imports neither, it leaves a one-shot import hook (tpudist._after_import) for the device.
route_helion_with_the_device()


def __getattr__(name):
    if name == "Topology":
        from tpudist.mesh import Topology

        return Topology
    if name in ("monitored_barrier", "cache_stats", "split_group"):
        import tpudist.process_group as pg

        return getattr(pg, name)
    raise AttributeError(f"module 'tpudist' has no attribute {name!r}")


__all__ = ["Topology", "__version__", "cache_stats", "monitored_barrier", "split_group"]
