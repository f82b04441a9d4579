"""DTensor <-> global ``jax.Array`` over the same devices, built from each rank's local shard.

Memory: :func:`to_jax` aliases the local shard's memory (``jax.device_put`` of a numpy view on the
CPU), and :func:`from_jax` views the JAX buffer through DLPack. Do not mutate one side in place while
the other is in use.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.placement_types import _StridedShard

from tpudist import bridge
from tpudist.sharding.layout import (JaxLayout, LayoutError, default_axis_names, is_even,
                                     padded_length, padded_positions, to_layout, to_placements)

_meshes: dict[tuple, tuple[Any, Any]] = {}  # mesh key -> (runtime, jax Mesh)
_lock = threading.Lock()


# -- meshes -----------------------------------------------------------------------------------------
def mesh_axis_names(device_mesh: DeviceMesh) -> tuple[str, ...]:
    """The DeviceMesh dim names, or ``axis0, axis1, ...`` when it has none."""
    names = device_mesh.mesh_dim_names
    return tuple(names) if names else default_axis_names(device_mesh.ndim)


def mesh_key(device_mesh: DeviceMesh) -> tuple:
    """What identifies a mesh on every rank: its global ranks (in order), shape and axis names."""
    return (tuple(device_mesh.mesh.flatten().tolist()), tuple(device_mesh.mesh.shape),
            mesh_axis_names(device_mesh))


def jax_mesh(device_mesh: DeviceMesh) -> Any:
    """The ``jax.sharding.Mesh`` of a DeviceMesh: same devices, same order, axis names = dim names.

    The JAX device of global rank ``r`` stands at the position of ``r`` in ``device_mesh.mesh``.
    Axis names are ``mesh_dim_names``, or ``axis0, axis1, ...`` for an unnamed mesh. All axes are
    ``Auto`` (XLA propagates shardings). Cached per mesh.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> jax_mesh(mesh).axis_names
        ('dp', 'tp')
    """
    from jax.sharding import AxisType, Mesh

    from tpudist.process_group import runtime

    key = mesh_key(device_mesh)
    rt = runtime.current()
    with _lock:
        booted, mesh = _meshes.get(key, (None, None))
        if booted is not rt:  # a new world (after destroy_process_group) has new devices
            ranks, shape, names = key
            devices = np.array([rt.device(r) for r in ranks], dtype=object).reshape(shape)
            mesh = Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))
            _meshes[key] = (rt, mesh)
        return mesh


def layout_of(dtensor: DTensor) -> JaxLayout:
    mesh = dtensor.device_mesh
    return to_layout(dtensor.placements, mesh_axis_names(mesh), dtensor.ndim, tuple(mesh.mesh.shape))


# -- torch <-> numpy views: tpudist.bridge's ----------------------------------------------------------
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a DTensor's local shard of ``dtype`` enters JAX as."""
    return np.dtype(bridge.NUMPY[dtype][1])


def x64(dtype: torch.dtype):
    """JAX truncates 64-bit types unless x64 is on for the call (FACTS.md); else leave it as it is."""
    return bridge.x64_scope(bridge.needs_x64((dtype,)))


# -- blocks: padded, partial-stacked global arrays used inside tpudist's programs -------------------
@dataclass(frozen=True, slots=True)
class BlockSpec:
    """How a DTensor sits in a global JAX array inside tpudist's programs.

    Each ``Partial`` axis adds a leading dim (one row per rank on that axis, sharded over it); each
    sharded dim is padded at the end of every shard to the largest shard (DTensor's chunk rule).
    """

    shape: tuple[int, ...]  # logical global shape
    layout: JaxLayout
    mesh_sizes: tuple[tuple[str, int], ...]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh_sizes)

    def padded_shape(self) -> tuple[int, ...]:
        sizes = self.sizes
        return tuple(padded_length(n, [sizes[a] for a in self.layout.dim_axes(d)])
                     for d, n in enumerate(self.shape))

    @property
    def even(self) -> bool:
        return is_even(self.shape, self.layout, self.sizes)

    def block_shape(self) -> tuple[int, ...]:
        sizes = self.sizes
        return (*(sizes[a] for a, _ in self.layout.partial_axes), *self.padded_shape())

    def block_spec(self) -> Any:
        from jax.sharding import PartitionSpec

        entries = list(self.layout.spec) + [None] * (len(self.shape) - len(self.layout.spec))
        return PartitionSpec(*(a for a, _ in self.layout.partial_axes), *entries)

    def local_block_shape(self) -> tuple[int, ...]:
        sizes = self.sizes
        padded = self.padded_shape()
        local = [n // math.prod(sizes[a] for a in self.layout.dim_axes(d)) for d, n in enumerate(padded)]
        return (*(1 for _ in self.layout.partial_axes), *local)


def block_spec_of(dtensor: DTensor) -> BlockSpec:
    mesh = dtensor.device_mesh
    names = mesh_axis_names(mesh)
    layout = layout_of(dtensor)
    spec = BlockSpec(tuple(dtensor.shape), layout, tuple(zip(names, mesh.mesh.shape)))
    if not spec.even and any(isinstance(p, _StridedShard) for p in dtensor.placements):
        raise LayoutError(f"placements={tuple(str(p) for p in dtensor.placements)} with shape="
                          f"{tuple(dtensor.shape)}: an uneven _StridedShard has no padded JAX layout; "
                          "use a shape divisible by the mesh or DTensor.redistribute")
    return spec


def to_block(dtensor: DTensor, spec: BlockSpec) -> Any:
    """The global (padded, partial-stacked) ``jax.Array`` of ``dtensor``; no copy if even."""
    import jax
    from jax.sharding import NamedSharding

    from tpudist.process_group import runtime

    local = dtensor.to_local()
    want = spec.local_block_shape()
    if tuple(local.shape) != want[len(spec.layout.partial_axes):]:
        pad = []
        for have, target in zip(reversed(local.shape), reversed(want)):
            pad += [0, target - have]
        local = torch.nn.functional.pad(local, pad) if local.numel() else local.new_zeros(
            want[len(spec.layout.partial_axes):])
    host = bridge.numpy_view(local)[0].reshape(want)
    mesh = jax_mesh(dtensor.device_mesh)
    with x64(dtensor.dtype):
        shard = jax.device_put(host, runtime.current().local_device)
        return jax.make_array_from_single_device_arrays(
            spec.block_shape(), NamedSharding(mesh, spec.block_spec()), [shard])


def from_block(array: Any, spec: BlockSpec, device_mesh: DeviceMesh,
               placements: Sequence[Placement]) -> DTensor:
    """The DTensor whose local shard is this process's block of ``array`` (padding cut off)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = bridge.torch_view(array.addressable_data(0))
    local = local.reshape(local.shape[len(spec.layout.partial_axes):])
    if not spec.even:
        true_shape, _ = compute_local_shape_and_global_offset(spec.shape, device_mesh, placements)
        local = local[tuple(slice(0, n) for n in true_shape)]
    return DTensor.from_local(local, device_mesh, tuple(placements), run_check=False,
                              shape=torch.Size(spec.shape), stride=_contiguous_strides(spec.shape))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# -- inside traced programs: padded block <-> logical array ----------------------------------------
_REDUCE = {"sum": "sum", "avg": "mean", "max": "max", "min": "min"}


def unpad(x: Any, spec: BlockSpec, lead: int) -> Any:
    """Padded block (after ``lead`` partial dims) -> logical array, inside a traced program."""
    import jax.numpy as jnp

    sizes = spec.sizes
    for dim, n in enumerate(spec.shape):
        axis_sizes = [sizes[a] for a in spec.layout.dim_axes(dim)]
        if x.shape[lead + dim] == n:
            continue
        positions = padded_positions(n, axis_sizes)
        if positions == list(range(n)):
            x = jax_slice(x, lead + dim, n)
        else:
            x = jnp.take(x, np.asarray(positions, dtype=np.int32), axis=lead + dim)
    return x


def pad(x: Any, spec: BlockSpec, lead: int) -> Any:
    """Logical array -> padded block (after ``lead`` partial dims), inside a traced program."""
    import jax.numpy as jnp

    sizes = spec.sizes
    for dim, (n, padded) in enumerate(zip(spec.shape, spec.padded_shape())):
        if padded == n:
            continue
        positions = padded_positions(n, [sizes[a] for a in spec.layout.dim_axes(dim)])
        if positions == list(range(n)):
            widths = [(0, 0)] * x.ndim
            widths[lead + dim] = (0, padded - n)
            x = jnp.pad(x, widths)
        else:
            shape = list(x.shape)
            shape[lead + dim] = padded
            index = [slice(None)] * x.ndim
            index[lead + dim] = np.asarray(positions, dtype=np.int32)
            x = jnp.zeros(shape, x.dtype).at[tuple(index)].set(x)
    return x


def jax_slice(x: Any, axis: int, length: int) -> Any:
    import jax

    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def reduce_partial(x: Any, src: BlockSpec, keep: tuple[tuple[str, str], ...] = ()) -> Any:
    """Applies the pending reductions of ``src`` not in ``keep`` (leading dims, one per axis)."""
    import jax.numpy as jnp

    for index in reversed(range(len(src.layout.partial_axes))):
        entry = src.layout.partial_axes[index]
        if entry in keep:
            continue
        x = getattr(jnp, _REDUCE[entry[1]])(x, axis=index).astype(x.dtype)  # jnp.sum widens small ints
    return x



# -- public conversions -----------------------------------------------------------------------------
def to_jax(dtensor: DTensor) -> Any:
    """The global ``jax.Array`` of a DTensor, sharded as its placements say, without a copy.

    Every rank of the DTensor's mesh calls it; each contributes its local shard. The sharding is
    ``NamedSharding(jax_mesh(mesh), to_partition_spec(placements, ...))``.

    Raises:
        LayoutError: for ``Partial`` (a pending reduction is not an array) or uneven shards (JAX
            needs even division). ``redistribute`` and ``spmd`` accept both.

    Example:
        >>> x = distribute_tensor(torch.arange(8.), mesh, [Shard(0)])
        >>> to_jax(x).sharding.spec
        P('dp',)
    """
    spec = block_spec_of(dtensor)
    if spec.layout.partial_axes:
        raise LayoutError(f"to_jax: placements={tuple(str(p) for p in dtensor.placements)} are pending a "
                          f"reduction on mesh axes {[a for a, _ in spec.layout.partial_axes]}; a jax.Array "
                          "cannot carry one. redistribute(x, [Replicate()...]) first, or pass x to spmd()")
    if not spec.even:
        raise LayoutError(f"to_jax: shape={tuple(dtensor.shape)} does not divide evenly under "
                          f"placements={tuple(str(p) for p in dtensor.placements)} on mesh "
                          f"{dict(spec.mesh_sizes)}; a jax.Array needs even shards. Use a divisible shape, "
                          "or pass x to spmd()/redistribute(), which pad and slice internally")
    return to_block(dtensor, spec)


def from_jax(array: Any, device_mesh: DeviceMesh) -> DTensor:
    """The DTensor of a global ``jax.Array``; placements come from its ``NamedSharding``.

    The array's devices must be ``jax_mesh(device_mesh)``'s (same order). The local shard views the
    JAX buffer (DLPack, no copy).

    Example:
        >>> from_jax(to_jax(x), x.device_mesh).placements == x.placements
        True
    """
    from jax.sharding import NamedSharding

    sharding = array.sharding
    mesh = jax_mesh(device_mesh)
    if not isinstance(sharding, NamedSharding):
        raise LayoutError(f"from_jax: array.sharding={sharding!r} is not a NamedSharding; reshard it with "
                          "jax.device_put(array, NamedSharding(jax_mesh(device_mesh), spec)) first")
    if sharding.mesh.devices.shape != mesh.devices.shape or list(sharding.mesh.devices.flat) != list(
            mesh.devices.flat):
        raise LayoutError(f"from_jax: the array lives on mesh {sharding.mesh.shape_tuple} whose devices differ "
                          f"from device_mesh={device_mesh} ({mesh.shape_tuple}); use jax_mesh(device_mesh)")
    if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
        raise LayoutError(f"from_jax: array mesh axis_names={sharding.mesh.axis_names} differ from "
                          f"device_mesh names={mesh.axis_names}")
    names = mesh_axis_names(device_mesh)
    placements = to_placements(sharding.spec, names, tuple(device_mesh.mesh.shape))
    layout = to_layout(placements, names, array.ndim, tuple(device_mesh.mesh.shape))
    spec = BlockSpec(tuple(array.shape), layout, tuple(zip(names, device_mesh.mesh.shape)))
    return from_block(array, spec, device_mesh, placements)


__all__ = ["from_jax", "jax_mesh", "mesh_axis_names", "to_jax"]
