"""Applying data, fully sharded and tensor parallelism to a :class:`Transformer`.

The order is torchtitan's: tensor parallelism first (it turns the block linears into DTensors on the
``tp`` axis), then activation checkpointing, then ``fully_shard`` per block and on the root over the
data-parallel axes (``dp_replicate`` x ``dp_shard`` is HSDP; ``dp_shard`` alone is FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MESH_AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Sizes of the three parallel mesh axes; their product is the world size.

    Example:
        >>> ParallelDims.from_sizes((1, 2, 2), world_size=4)
        ParallelDims(dp_replicate=1, dp_shard=2, tp=2)
    """

    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_sizes(cls, sizes: tuple[int, ...], world_size: int) -> "ParallelDims":
        """Canonicalises ``--mesh``: ``()`` means all ranks shard (``1,world,1``)."""
        dims = cls(1, world_size, 1) if not sizes else cls(*sizes)
        if min(dims.sizes) < 1 or dims.dp_replicate * dims.dp_shard * dims.tp != world_size:
            raise ValueError(f"mesh={dims.sizes} (dp_replicate,dp_shard,tp) must multiply to "
                             f"world_size={world_size}; e.g. --mesh 1,{world_size},1")
        return dims

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def build_mesh(dims: ParallelDims, device_type: str = "cpu"):
    """A ``DeviceMesh`` over the axes of ``dims`` larger than 1 (``dp_shard`` always kept).

    ``device_type`` is where the model's tensors live ("tpu" for the tpudist device): FSDP2 moves
    parameters to its mesh's device.

    Ranks are laid onto the chips of the slice (``TPUDIST_TOPOLOGY``, or the smallest that fits)
    by ``tpudist.mesh``: axes ordered by increasing traffic (dp_replicate, dp_shard, tp) so that
    the busiest, tp, follows torus rings. The DeviceMesh's groups inherit the default group's
    backend, "tpu" under ``init_process_group("tpu")``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(name for name, size in zip(MESH_AXES, dims.sizes) if size > 1 or name == "dp_shard")
    shape = tuple(getattr(dims, name) for name in names)
    ranks = mesh_layout(shape, names, dist.get_world_size()).rank_array
    return DeviceMesh(device_type, torch.as_tensor(ranks), mesh_dim_names=names)


def mesh_layout(shape: tuple[int, ...], names: tuple[str, ...], world_size: int):
    """The ``tpudist.mesh`` layout of a logical mesh on this job's (emulated) slice."""
    from tpudist.process_group.runtime import topology_for

    return topology_for(world_size).mesh_layout(shape, axis_names=names,
                                                allow_split_physical_axes=True)


def dp_mesh(mesh):
    """The data-parallel sub-mesh: ``(dp_replicate, dp_shard)`` for HSDP, else ``(dp_shard,)``."""
    names = tuple(n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names)
    return mesh[names]


def dp_coordinate(mesh) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank: which slice of the global batch it reads."""
    rank, size = 0, 1
    for name in ("dp_replicate", "dp_shard"):
        if name in mesh.mesh_dim_names:
            axis_size = mesh.size(mesh.mesh_dim_names.index(name))
            rank, size = rank * axis_size + mesh.get_local_rank(name), size * axis_size
    return rank, size


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron-style plan: q/k/v and w1/w3 split by output features, wo and w2 by input features.

    Each block then needs one all-reduce in attention and one in the MLP (forward and backward).
    Embeddings, norms and the output layer stay replicated on ``tp_mesh``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    args = model.args
    tp = tp_mesh.size()
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ValueError(f"tensor parallelism splits heads: n_heads={args.n_heads} and "
                         f"n_kv_heads={args.n_kv_heads} must be divisible by tp={tp}")
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wraps every block so its activations are recomputed in backward instead of kept."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, backend: str = "tpu") -> None:
    """Compiles each block's forward (static shapes, whole graph); FSDP2's hooks stay eager around it.

    Compiling ``forward`` rather than wrapping the module keeps parameter names (checkpoints load
    either way). With backend "tpu" a tensor-parallel block's collectives run inside its program.
    """
    for block in model.layers:
        block = getattr(block, "_checkpoint_wrapped_module", block)  # checkpointing re-runs it as is
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, dynamic=False)


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool | int = True) -> None:
    """``fully_shard`` on each block and on the root; gradients are reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters are used last in forward and first in backward: keeping them is free.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def parallelize(model: nn.Module, mesh, *, parallelism: str = "fsdp", param_dtype: torch.dtype = torch.float32,
                reshard_after_forward: bool | int = True, activation_checkpoint: bool = False,
                compile_backend: str = "") -> nn.Module:
    """Applies TP (if ``mesh`` has a ``tp`` axis), checkpointing, then FSDP2 or DDP; returns the model."""
    if "tp" in mesh.mesh_dim_names:
        if parallelism == "ddp":
            raise ValueError("parallelism='ddp' does not combine with tp; use parallelism='fsdp' with --mesh")
        apply_tp(model, mesh["tp"])
    if activation_checkpoint:
        apply_activation_checkpointing(model)
    if compile_backend:
        apply_compile(model, compile_backend)
    if parallelism == "ddp":
        if param_dtype != torch.float32:
            raise ValueError(f"param_dtype={param_dtype} needs parallelism='fsdp' (DDP trains in float32)")
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)  # without tp every rank is a data-parallel replica
    apply_fsdp(model, dp_mesh(mesh), param_dtype=param_dtype, reshard_after_forward=reshard_after_forward)
    return model
