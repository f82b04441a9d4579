"""Kernels on DTensors: shard by shard, or one XLA program over the DTensors' mesh.

Each kernel's two ops get a ``torch_dispatch`` rule for ``DTensor`` (``CustomOpDef.register_torch_dispatch``),
so DTensors reach it however the op is called (the kernel object, ``torch.ops``, autograd's backward):

- ``shard_dims`` declared: the placements are checked against it (``shard_spec.plan_local``), the
  op runs on each rank's local shards (no communication, uneven shards included) and the outputs
  are DTensors on the same mesh. Gradients of inputs replicated on an axis that shards the data
  come back ``Partial`` there.
- no ``shard_dims``: the function runs as one program over the mesh through
  ``tpudist.sharding.spmd`` (only the mesh's ranks take part: sub-meshes such as ``mesh["tp"]``
  work). Inside, ``current_mesh()`` is that ``jax.sharding.Mesh``, for kernels that call
  ``jax.shard_map`` with collectives over its axes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from tpudist.kernels.errors import KernelInputError
from tpudist.kernels.shard_spec import plan_local

_state = threading.local()


def current_mesh():
    """The ``jax.sharding.Mesh`` of the DTensors a mesh kernel is tracing for (None outside one).

    Example:
        >>> @custom_jax_kernel("mylib::tp_norm")          # no shard_dims: runs over the mesh
        ... def tp_norm(x):
        ...     mesh = current_mesh()
        ...     local = lambda b: b / jax.lax.psum(b.sum(-1, keepdims=True), "tp")
        ...     return jax.shard_map(local, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"))(x)
    """
    return getattr(_state, "mesh", None)


@contextlib.contextmanager
def _mesh_scope(mesh):
    previous = getattr(_state, "mesh", None)
    _state.mesh = mesh
    try:
        yield
    finally:
        _state.mesh = previous


def register(kernel, forward_def, backward_def) -> None:
    from torch.distributed.tensor import DTensor

    from tpudist.sharding import spmd

    def forward_over_mesh(*arrays, **statics):
        return kernel.traced(statics)(*arrays)

    def backward_over_mesh(*arrays, **statics):
        return kernel.traced_backward(statics)(*arrays)

    forward_over_mesh.__qualname__ = f"{kernel.name}.forward"
    backward_over_mesh.__qualname__ = f"{kernel.name}.backward"
    over_mesh = (spmd(forward_over_mesh), spmd(backward_over_mesh))

    def forward_rule(cls, func, types, args, kwargs):
        return _forward(kernel, func, over_mesh[0], args, kwargs or {})

    def backward_rule(cls, func, types, args, kwargs):
        return _backward(kernel, func, over_mesh[1], args, kwargs or {})

    forward_def.register_torch_dispatch(DTensor, forward_rule)
    backward_def.register_torch_dispatch(DTensor, backward_rule)


def _mesh_of(kernel, tensors):
    from torch.distributed.tensor import DTensor

    mesh = None
    for name, t in zip(kernel.tensor_names, tensors):
        if t is None:
            continue
        if not isinstance(t, DTensor):
            raise KernelInputError(
                f"kernel {kernel.name}: {name} is a plain torch.Tensor of shape {tuple(t.shape)} among DTensor "
                f"arguments; make every tensor a DTensor on one mesh (distribute_tensor(t, mesh, "
                "[Replicate()]) or DTensor.from_local)")
        if mesh is None:
            mesh, first = t.device_mesh, name
        elif t.device_mesh is not mesh and t.device_mesh != mesh:  # (no tensor ops: fake mode under compile)
            raise KernelInputError(f"kernel {kernel.name}: {name} lives on {t.device_mesh}, {first} on {mesh}; "
                                   "redistribute them onto one mesh")
    return mesh


def _names(kernel) -> list[str]:
    return list(kernel.tensor_names)


def _forward(kernel, func, over_mesh, args, kwargs) -> Any:
    from torch.distributed.tensor import DTensor

    from tpudist.sharding import mesh_axis_names

    tensors = kernel.pad(args)
    statics = kernel.statics(kwargs)
    mesh = _mesh_of(kernel, tensors)
    if kernel.shard_dims is None:
        return _over_mesh(kernel, over_mesh, mesh, tensors, tensors, statics)
    outs = kernel.abstract_outputs(tensors, statics)  # checks the global shapes and dtypes
    plan = plan_local(kernel.shard_dims, kernel.name, _names(kernel), tensors, mesh_axis_names(mesh),
                      [len(shape) for shape, _ in outs])
    local = func(*[None if t is None else t._local_tensor for t in tensors], **kwargs)  # noqa: SLF001
    local = (local,) if kernel.num_outputs == 1 else local
    results = tuple(DTensor.from_local(piece, mesh, placements, run_check=False, shape=torch.Size(shape),
                                       stride=_strides(shape))
                    for piece, placements, (shape, _) in zip(local, plan.output_placements, outs))
    return results[0] if kernel.num_outputs == 1 else results


def _backward(kernel, func, over_mesh, args, kwargs) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    from tpudist.sharding import mesh_axis_names

    *tensors, grads = args
    statics = kernel.statics(kwargs)
    mesh = _mesh_of(kernel, tensors)
    if kernel.shard_dims is None:
        return _over_mesh(kernel, over_mesh, mesh, tensors, (*tensors, *grads), statics)
    outs = kernel.abstract_outputs(tensors, statics)
    plan = plan_local(kernel.shard_dims, kernel.name, _names(kernel), tensors, mesh_axis_names(mesh),
                      [len(shape) for shape, _ in outs])
    aligned = []
    for g, placements in zip(grads, plan.output_placements):
        if not isinstance(g, DTensor):
            g = DTensor.from_local(g, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if tuple(g.placements) != tuple(placements):
            g = g.redistribute(mesh, placements)
        aligned.append(g._local_tensor)  # noqa: SLF001
    local = func(*[None if t is None else t._local_tensor for t in tensors], aligned, **kwargs)  # noqa: SLF001
    local = (local,) if len(tensors) == 1 else local
    results = []
    for piece, t, placements in zip(local, tensors, plan.grad_placements):
        if t is None:
            results.append(DTensor.from_local(piece, mesh, [Replicate()] * mesh.ndim, run_check=False))
        else:
            results.append(DTensor.from_local(piece, mesh, placements, run_check=False, shape=t.shape,
                                              stride=t.stride()))
    return results[0] if len(results) == 1 else tuple(results)


def _over_mesh(kernel, program, mesh, inputs, tensors, statics) -> Any:
    from torch._subclasses.fake_tensor import is_fake

    from tpudist.sharding import jax_mesh

    if any(t is not None and is_fake(t._local_tensor) for t in tensors):  # noqa: SLF001
        raise NotImplementedError(
            f"kernel {kernel.name} has no shard_dims, so on DTensors it runs as its own XLA program over "
            "the mesh, which torch.compile cannot trace into a graph; call it outside the compiled region "
            "(torch.compiler.disable) or, if it works shard by shard, declare shard_dims")

    with torch.no_grad(), _mesh_scope(jax_mesh(mesh)):
        kernel.abstract_outputs(inputs, statics)  # checks the global shapes and dtypes
        return program(*tensors, **statics)


def _strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


__all__ = ["current_mesh"]
