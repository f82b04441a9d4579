"""``spmd``: run a JAX function over DTensors as one XLA program across their mesh."""

from __future__ import annotations

import functools
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate

from tpudist import bridge
from tpudist.sharding import arrays
from tpudist.sharding.arrays import BlockSpec, pad, reduce_partial, unpad
from tpudist.sharding.layout import LayoutError
from tpudist.sharding.plan import (DEFAULT_TIMEOUT, Path, Plan, digest, environment, run_in_order,
                                   settle)

_programs: dict[tuple, tuple[Any, Any, str]] = {}
_lock = threading.Lock()


def spmd(fn: Callable | None = None, *, out_placements: Sequence[Placement] | None = None,
         on_mismatch: str = "mpmd", timeout: timedelta = DEFAULT_TIMEOUT) -> Callable:
    """Decorator: ``fn`` (a JAX function) runs over DTensor arguments as one program on their mesh.

    DTensor arguments (anywhere in ``args``/``kwargs``) become global ``jax.Array``s with their
    shardings (``Partial`` reduced and uneven shards unpadded inside the program, so ``fn`` sees the
    logical global values); other leaves are static (hashable). All DTensors must share one mesh,
    which may be a sub-mesh (``device_mesh["tp"]``): only its ranks take part. Outputs come back as
    DTensors with placements from the output shardings XLA chose, or ``out_placements`` for every
    output if given.

    Dots and convolutions in ``fn`` without a precision of their own run at torch's float32 matmul
    precision of the call (``tpudist.matmul_precision``), as torch ops on the device do.

    The program is not part of torch autograd: inputs that require grad raise ``ValueError``
    (use ``torch.no_grad()``, and ``jax.grad`` inside ``fn``). Every rank of the mesh calls the
    function with the same meaning. If ranks compiled different
    programs (e.g. rank 0 adds ``jax.debug.print``), ``on_mismatch="mpmd"`` runs ``fn`` on each rank
    over the full tensors (gathered with DTensor's own collectives); outputs are then Replicate unless
    ``out_placements`` is given.

    Example:
        >>> @spmd
        ... def matmul(a, b):
        ...     return a @ b
        >>> c = matmul(a, b)   # a: Shard(0), b: Replicate on mesh ("dp",) -> c: Shard(0)
    """
    if fn is None:
        return functools.partial(spmd, out_placements=out_placements, on_mismatch=on_mismatch,
                                 timeout=timeout)
    out_placements = None if out_placements is None else tuple(out_placements)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from tpudist import matmul_precision

        with matmul_precision.scope(matmul_precision.current()):
            return _call(fn, out_placements, on_mismatch, timeout, args, kwargs)

    return run


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _call(fn: Callable, out_placements: tuple[Placement, ...] | None, on_mismatch: str,
          timeout: timedelta, args: tuple, kwargs: dict) -> Any:
    import jax

    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_dtensor)
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, DTensor)]
    if not tensor_at:
        raise ValueError(f"spmd({_name(fn)}): no DTensor argument; spmd needs one to know the mesh")
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            raise TypeError(f"spmd({_name(fn)}): argument leaf {i} is a plain torch.Tensor of shape "
                            f"{tuple(x.shape)}; wrap it as a DTensor (e.g. Replicate) so its layout is known")
    dtensors = [leaves[i] for i in tensor_at]
    device_mesh = dtensors[0].device_mesh
    key = arrays.mesh_key(device_mesh)
    for i, x in zip(tensor_at, dtensors):
        if arrays.mesh_key(x.device_mesh) != key:
            raise ValueError(f"spmd({_name(fn)}): argument leaf {i} lives on mesh {x.device_mesh}, the first "
                             f"DTensor on {device_mesh}; redistribute them onto one mesh")
    if torch.is_grad_enabled() and any(x.requires_grad for x in dtensors):
        raise ValueError(f"spmd({_name(fn)}): an input requires grad, but the XLA program is not part of "
                         "torch autograd; call it under torch.no_grad() (and take gradients with jax.grad "
                         "inside fn) or detach the inputs")
    statics = tuple((i, x) for i, x in enumerate(leaves) if i not in tensor_at)
    meaning = digest("spmd", _name(fn), key, str(treedef), repr(statics), repr(out_placements),
                     tuple((tuple(x.shape), str(x.dtype), tuple(map(repr, x.placements))) for x in dtensors))
    plan = Plan(f"spmd({_name(fn)})", Path.SPMD, "all inputs have a JAX layout", (), meaning)
    try:
        specs = tuple(arrays.block_spec_of(x) for x in dtensors)
    except LayoutError as e:
        plan = Plan(plan.op, Path.MPMD, str(e), (), meaning)
    if plan.path is Path.SPMD:
        jmesh = arrays.jax_mesh(device_mesh)
        with arrays.x64(_widest(dtensors)):
            blocks = [arrays.to_block(x, s) for x, s in zip(dtensors, specs)]
            program, out_specs, text_digest = _program_for(fn, jmesh, device_mesh, treedef, leaves, tensor_at,
                                                           specs, blocks, out_placements)
        plan = plan.with_program(digest(text_digest, environment()))
    description = f"{plan.op} over {[tuple(map(str, x.placements)) for x in dtensors]}"
    path = settle(plan, key[0], digest(key), description, on_mismatch, timeout)
    if path is Path.MPMD:
        return _run_mpmd(fn, out_placements, treedef, leaves, tensor_at, device_mesh)
    def run():
        with arrays.x64(_widest(dtensors)):
            return jax.block_until_ready(program(*blocks))

    outs = run_in_order(description, run, timeout)
    out_leaves, out_tree = jax.tree_util.tree_flatten(outs)
    return jax.tree_util.tree_unflatten(out_tree, [
        _to_dtensor(o, s, device_mesh) for o, s in zip(out_leaves, out_specs or [None] * len(out_leaves))])


def _program_for(fn, jmesh, device_mesh, treedef, leaves, tensor_at, specs, blocks, out_placements):
    import jax
    from jax.sharding import NamedSharding

    from tpudist.process_group.programs import CachedProgram

    from tpudist import matmul_precision

    statics = tuple((i, leaves[i]) for i in range(len(leaves)) if i not in tensor_at)
    # the matmul precision the program is traced at (spmd's caller set it from torch's)
    key = (fn, jmesh, str(treedef), statics, specs, tuple(str(b.dtype) for b in blocks), out_placements,
           matmul_precision.STATE.value)
    with _lock:
        hit = _programs.get(key)
    if hit is not None:
        return hit

    template = [None if i in tensor_at else x for i, x in enumerate(leaves)]  # hold no DTensor

    def logical(*blocks_):
        values = list(template)
        for i, b, s in zip(tensor_at, blocks_, specs):
            values[i] = unpad(reduce_partial(b, s), s, 0)
        args, kwargs = jax.tree_util.tree_unflatten(treedef, values)
        return fn(*args, **kwargs)

    abstract = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding) for b in blocks]
    out_specs = None
    if out_placements is None:
        jitted = jax.jit(logical)
    else:
        names = arrays.mesh_axis_names(device_mesh)
        mesh_sizes = tuple(zip(names, device_mesh.mesh.shape))
        shapes, out_tree = jax.tree_util.tree_flatten(jax.eval_shape(logical, *abstract))
        out_specs = [BlockSpec(tuple(s.shape), arrays.to_layout(out_placements, names, len(s.shape),
                                                                tuple(device_mesh.mesh.shape)), mesh_sizes)
                     for s in shapes]
        if any(s.layout.partial_axes for s in out_specs):
            raise LayoutError(f"spmd({_name(fn)}): out_placements={tuple(map(str, out_placements))} hold a "
                              "Partial; outputs of a JAX program are reduced values")

        def padded(*blocks_):
            outs = jax.tree_util.tree_leaves(logical(*blocks_))
            return jax.tree_util.tree_unflatten(out_tree, [pad(o, s, 0) for o, s in zip(outs, out_specs)])

        shardings = jax.tree_util.tree_unflatten(out_tree, [NamedSharding(jmesh, s.block_spec()) for s in out_specs])
        jitted = jax.jit(padded, out_shardings=shardings)
    # The executable comes from tpudist's program cache at the first call (keyed by the lowered
    # program and the mesh's devices): the next world's ranks, and a rank after its peer, load it.
    text_digest = digest(jitted.lower(*abstract).as_text())
    hit = (CachedProgram(jitted, list(jmesh.devices.flat), ("spmd", text_digest)), out_specs, text_digest)
    with _lock:
        _programs[key] = hit
    return hit


def _to_dtensor(array: Any, spec: BlockSpec | None, device_mesh) -> DTensor:
    if spec is None:
        return arrays.from_jax(array, device_mesh)
    names = arrays.mesh_axis_names(device_mesh)
    return arrays.from_block(array, spec, device_mesh,
                             arrays.to_placements(spec.layout, names, tuple(device_mesh.mesh.shape)))


def _run_mpmd(fn, out_placements, treedef, leaves, tensor_at, device_mesh) -> Any:
    """Every rank runs ``fn`` on the full tensors, gathered with DTensor's own collectives."""
    import jax
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from tpudist.process_group import runtime

    values = list(leaves)
    fulls = [leaves[i].full_tensor() for i in tensor_at]
    device = runtime.current().local_device
    with arrays.x64(_widest([leaves[i] for i in tensor_at])):
        for i, full in zip(tensor_at, fulls):
            values[i] = jax.device_put(bridge.numpy_view(full)[0], device)
        args, kwargs = jax.tree_util.tree_unflatten(treedef, values)
        outs = jax.jit(fn)(*args, **kwargs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(outs)
        results = []
        for o in out_leaves:
            full = bridge.torch_view(o)
            placements = out_placements or (Replicate(),) * device_mesh.ndim
            shape, offset = compute_local_shape_and_global_offset(full.shape, device_mesh, placements)
            local = full[tuple(slice(o_, o_ + n) for o_, n in zip(offset, shape))]
            results.append(DTensor.from_local(local, device_mesh, placements, run_check=False,
                                              shape=full.shape, stride=full.stride()))
    return jax.tree_util.tree_unflatten(out_tree, results)


def _widest(dtensors: Sequence[DTensor]) -> torch.dtype:
    return max((x.dtype for x in dtensors), key=lambda d: d.itemsize)


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


__all__ = ["spmd"]
