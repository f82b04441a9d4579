"""DTensor on the "tpu" backend: distribute, redistribute, full_tensor, from_local, against the full tensor.

Values are integer-valued floats, so every sum is exact and results must match bit for bit. Shapes
are uneven (5x7 does not divide by 2 or 4) so the padded all-gathers and uneven shards are exercised.
"""

from __future__ import annotations

import itertools

import torch


SHAPE = (5, 7)


def full_tensor() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) - 11.0


def expected_local(full: torch.Tensor, placements, coordinate) -> torch.Tensor:
    """The shard a rank at mesh ``coordinate`` holds: ``torch.chunk`` per sharded axis, in mesh-axis order."""
    local = full
    for placement, (index, size) in zip(placements, coordinate):
        if placement.is_shard():
            chunks = local.chunk(size, dim=placement.dim)
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


def partial_local(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s addend of ``full``: the addends differ per rank and sum exactly to ``full``."""
    offset = torch.arange(full.numel(), dtype=full.dtype).reshape(full.shape) % 3 + 1
    return full - offset * (world - 1) if rank == 0 else offset.clone()


def placements_1d():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)]


def placements_2d():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Replicate()),
            (Partial(), Shard(0)), (Replicate(), Replicate())]


def make_dtensor(full, mesh, placements):
    """``full`` as a DTensor with ``placements``; Partial axes built with ``from_local``."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not any(p.is_partial() for p in placements):
        return distribute_tensor(full, mesh, list(placements))
    partial_axis = next(i for i, p in enumerate(placements) if p.is_partial())
    addend = partial_local(full, mesh.get_local_rank(partial_axis), mesh.size(partial_axis))
    as_replicated = [Replicate() if p.is_partial() else p for p in placements]
    local = expected_local(addend, as_replicated, coordinates(mesh))
    return DTensor.from_local(local, mesh, list(placements), shape=full.shape, stride=full.stride())


def coordinates(mesh):
    return [(mesh.get_local_rank(axis), mesh.size(axis)) for axis in range(mesh.ndim)]


def check_all_transitions(mesh_shape: tuple[int, ...]) -> list[str]:
    """Every (source, target) placement pair on a mesh: returns the failures as text (empty: all good)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    full = full_tensor()
    choices = placements_1d() if len(mesh_shape) == 1 else placements_2d()
    failures = []
    for src, dst in itertools.product(choices, choices):
        if any(p.is_partial() for p in dst) and src != dst:
            continue  # redistributing to Partial is defined only from Partial
        name = f"{src}->{dst}"
        dt = make_dtensor(full, mesh, src)
        if not torch.equal(dt.full_tensor(), full):
            failures.append(f"{name}: full_tensor of the source differs")
        moved = dt.redistribute(mesh, list(dst))
        if not torch.equal(moved.full_tensor(), full):
            failures.append(f"{name}: full_tensor after redistribute differs")
        if not any(p.is_partial() for p in dst):
            want = expected_local(full, dst, coordinates(mesh))
            if not torch.equal(moved.to_local(), want):
                failures.append(f"{name}: local shard {tuple(moved.to_local().shape)} != expected {tuple(want.shape)}")
    return failures


def check_ops(mesh_shape: tuple[int, ...]) -> list[str]:
    """A sharded matmul and reduction against the same ops on full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    a, b = full_tensor(), full_tensor().T.contiguous()
    inner = [Shard(1)] + [Replicate()] * (mesh.ndim - 1)
    product = distribute_tensor(a, mesh, inner) @ distribute_tensor(b, mesh, [Shard(0)] + inner[1:])
    failures = []
    if not torch.equal(product.full_tensor(), a @ b):
        failures.append("S(1) @ S(0) (a Partial sum) differs from the full matmul")
    total = distribute_tensor(a, mesh, [Shard(0)] * mesh.ndim).sum()
    if not torch.equal(total.full_tensor(), a.sum()):
        failures.append("sum over a sharded tensor differs")
    return failures


def test_redistribute_1d(pool2):
    assert pool2.run(check_all_transitions, (2,)) == [[], []]


def test_ops_1d(pool2):
    assert pool2.run(check_ops, (2,)) == [[], []]


def test_redistribute_2d(pool4):
    assert pool4.run(check_all_transitions, (2, 2)) == [[]] * 4


def test_ops_2d(pool4):
    assert pool4.run(check_ops, (2, 2)) == [[]] * 4


def test_expected_local_is_torch_chunk():
    """The oracle itself, on one process: uneven chunks, and the empty shard when chunks run out."""
    from torch.distributed.tensor import Replicate, Shard

    full = full_tensor()
    assert expected_local(full, (Shard(0),), [(1, 2)]).shape == (2, 7)
    assert expected_local(full, (Shard(0), Shard(0)), [(1, 2), (1, 2)]).shape == (1, 7)
    assert expected_local(torch.zeros(1, 3), (Shard(0),), [(1, 2)]).shape == (0, 3)
    assert torch.equal(expected_local(full, (Replicate(), Shard(1)), [(0, 2), (1, 2)]), full[:, 4:])
    world = 4
    assert torch.equal(sum(partial_local(full, r, world) for r in range(world)), full)
