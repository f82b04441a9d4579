"""tpudist.sharding across real rank processes (2 and 4), checked against DTensor's own results.

Rank-side cases are module-level functions returning a list of problems (empty = pass).
"""

from __future__ import annotations

import itertools
import random
from datetime import timedelta

import pytest
import torch

from tpudist.testing import RankPool

# -- rank side ---------------------------------------------------------------------------------------
_meshes: dict = {}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names))
    if key not in _meshes:
        _meshes[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return _meshes[key]


def _meshes_for(world, unnamed=False):
    meshes = [_mesh((world,), ("x",))]
    if unnamed:
        from torch.distributed.device_mesh import init_device_mesh

        if "unnamed" not in _meshes:
            _meshes["unnamed"] = init_device_mesh("cpu", (world,))
        meshes.append(_meshes["unnamed"])
    if world == 4:
        meshes.append(_mesh((2, 2), ("dp", "tp")))
    return meshes


def _full(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 9, shape, generator=g)
    return values.to(dtype) if dtype != torch.bool else values > 0


def _make(full, mesh, placements):
    """A DTensor with these placements whose Partial axes hold rank-dependent partial values."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = distribute_tensor(full, mesh, plain).to_local().clone()
    coord = mesh.get_coordinate()
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            local = local + (coord[axis] + 1) * (axis + 1)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _same(label, got, want, problems):
    if got.placements != want.placements:
        problems.append(f"{label}: placements {got.placements} != {want.placements}")
        return
    a, b = got.to_local(), want.to_local()
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        problems.append(f"{label}: local {tuple(a.shape)} {a.dtype} {a.flatten()[:6].tolist()} != "
                        f"{tuple(b.shape)} {b.dtype} {b.flatten()[:6].tolist()}")


def _axis_options(ndim):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [Replicate(), *(Shard(d) for d in range(ndim)), Partial("sum"), Partial("avg"), Partial("max")]


def case_roundtrip(world):
    """to_jax gives the spec the translator promises and the local shard; from_jax inverts it."""
    import numpy as np

    from tpudist.sharding import from_jax, mesh_axis_names, to_jax, to_partition_spec

    problems = []
    meshes = _meshes_for(world, unnamed=True)
    for mesh in meshes if world == 2 else meshes[2:]:  # 4 ranks: the 2-D mesh (1-D is covered by 2)
        names = mesh_axis_names(mesh)
        options = [p for p in _axis_options(2) if not p.is_partial()]
        for placements in itertools.product(options, repeat=mesh.ndim):
            named = mesh.mesh_dim_names is not None
            dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.bool) if named and mesh.ndim == 1 else (
                torch.float32,)
            for dtype in dtypes:
                full = _full((4, 8), dtype, seed=1)
                x = _make(full, mesh, placements)
                label = f"mesh={names} {placements} {dtype}"
                arr = to_jax(x)
                want_spec = to_partition_spec(placements, names, 2)
                if arr.sharding.spec != want_spec or arr.shape != (4, 8):
                    problems.append(f"{label}: to_jax spec {arr.sharding.spec} shape {arr.shape}")
                local = torch.from_dlpack(arr.addressable_data(0))
                if not torch.equal(local, x.to_local()):
                    problems.append(f"{label}: to_jax local shard differs")
                if dtype == torch.float32 and np.shares_memory(np.asarray(arr.addressable_data(0)),
                                                               x.to_local().numpy()) is False:
                    problems.append(f"{label}: to_jax copied a contiguous float32 shard")
                _same(label + " from_jax", from_jax(arr, mesh), x, problems)
    # What a jax.Array cannot hold is a clear error, not a wrong array.
    from torch.distributed.tensor import Partial, Shard

    from tpudist.sharding import LayoutError

    mesh, other = _meshes_for(world, unnamed=True)[:2]
    for x, text in [(_make(_full((4, 2), torch.float32, 0), mesh, [Partial()]), "are pending a reduction"),
                    (_make(_full((5, 2), torch.float32, 0), mesh, [Shard(0)]),
                     f"to_jax: shape=(5, 2) does not divide evenly under placements=('S(0)',) on mesh {{'x': {world}}}")]:
        try:
            to_jax(x)
            problems.append(f"to_jax({x.placements}) did not raise")
        except LayoutError as e:
            if text not in str(e):
                problems.append(f"to_jax error: {e}")
    try:
        from_jax(to_jax(_make(_full((4, 2), torch.float32, 0), mesh, [Shard(0)])), other)
        problems.append("from_jax onto a mesh with other axis names did not raise")
    except LayoutError as e:
        if "differ from device_mesh names=('axis0',)" not in str(e):
            problems.append(f"from_jax error: {e}")
    return problems


def case_redistribute(world, shapes, num_pairs, seed):
    """redistribute(x, dst) == x.redistribute(mesh, dst), for src/dst pairs, even and uneven shapes."""
    from torch.distributed.tensor import Partial

    from tpudist.sharding import Path, path_counts, plan_redistribute, redistribute

    problems = []
    before = path_counts()
    num_calls = 0
    rng = random.Random(seed)
    # 2 ranks cover the 1-D mesh; 4 ranks spend their time on the 2-D one.
    for mesh in _meshes_for(world)[-1:]:
        options = _axis_options(2)
        every = [c for c in itertools.product(options, repeat=mesh.ndim)  # DTensor: one Partial op per list
                 if len({p.reduce_op for p in c if isinstance(p, Partial)}) <= 1]
        pairs = [(s, d) for s in every for d in every if s != d
                 and not any(isinstance(q, Partial) and q != p for p, q in zip(s, d))]  # DTensor: no new Partial
        pairs = pairs if len(pairs) <= num_pairs else rng.sample(pairs, num_pairs)
        for shape in shapes:
            for index, (src, dst) in enumerate(pairs):
                dtype = (torch.float32, torch.int32, torch.bfloat16, torch.int64, torch.int8)[index % 5]
                if not dtype.is_floating_point and any(p.is_partial() and p.reduce_op == "avg" for p in src):
                    dtype = torch.float32
                x = _make(_full(shape, dtype, seed=index), mesh, src)
                label = f"mesh={mesh.mesh_dim_names} shape={shape} {dtype} {src}->{dst}"
                plan = plan_redistribute(x, dst)
                if plan.path is not Path.SPMD:
                    problems.append(f"{label}: planned {plan}")
                got = redistribute(x, dst)
                num_calls += 1
                _same(label, got, x.redistribute(mesh, dst), problems)
    # What JAX cannot do takes DTensor's own redistribute, and the plan says why.
    from torch.distributed.tensor import Replicate, Shard

    mesh = _meshes_for(world)[0]
    full = _full((4, 6), torch.float32, seed=11)
    for src, dst, grad, reason in [
            ([Shard(0)], [Replicate()], True, "the input requires grad"),
            ([Partial("product")], [Replicate()], False, "reduce_op='product' has no XLA collective"),
            ]:
        x = _make(full, mesh, src).requires_grad_(grad)
        plan = plan_redistribute(x, dst)
        if plan.path is not Path.MPMD or reason not in plan.reason:
            problems.append(f"{src}->{dst}: {plan}")
        got = redistribute(x, dst)
        if grad and got.grad_fn is None:
            problems.append(f"{src}->{dst}: lost autograd")
        _same(f"mpmd {src}->{dst}", got.detach(), x.detach().redistribute(mesh, dst), problems)
    spmd_runs = path_counts().get(("redistribute", Path.SPMD), 0) - before.get(("redistribute", Path.SPMD), 0)
    if spmd_runs != num_calls:
        problems.append(f"{spmd_runs} of {num_calls} redistribute calls ran as one SPMD program")
    return problems


def case_compiled_collectives(world):
    """The SPMD program of each basic transition contains the collective the table promises."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tpudist.sharding.redistribute import compiled_text

    mesh = _mesh((world,), ("x",))
    full = _full((8, 8), torch.float32, seed=0)
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    found = {}  # transition -> collectives in the optimised HLO
    for src, dst in [(Shard(0), Replicate()), (Partial(), Replicate()), (Partial(), Shard(0)),
                     (Shard(0), Shard(1)), (Replicate(), Shard(0))]:
        text = compiled_text(_make(full, mesh, [src]), [dst])
        found[f"{src}->{dst}"] = sorted(k for k in kinds if f" {k}(" in text or f"{k}-start(" in text)
    return found


def case_spmd(world):
    """spmd(fn) over DTensors equals fn on the full tensors; full mesh, sub-mesh, Partial, uneven."""
    import jax.numpy as jnp
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tpudist.sharding import spmd

    @spmd
    def step(a, b, scale):
        return {"mm": a @ b * scale, "colsum": a.sum(0), "act": jnp.tanh(a)}

    problems = []
    meshes = _meshes_for(world)
    if world == 4:  # the 2-D mesh and a sub-mesh of it (two programs, one per tp group)
        meshes = [meshes[-1], meshes[-1]["tp"]]
    for mesh in meshes:
        for shape_a, pa, pb in [((8, 4), Shard(0), Replicate()), ((6, 4), Replicate(), Shard(1)),
                                ((5, 4), Shard(0), Replicate()), ((8, 4), Partial("sum"), Shard(0)),
                                ((7, 4), Shard(1), Partial("max"))]:
            pa_, pb_ = [pa] * mesh.ndim, [pb] * mesh.ndim
            a = _make(_full(shape_a, torch.float32, seed=3), mesh, pa_)
            b = _make(_full((4, 6), torch.float32, seed=4), mesh, pb_)
            fa, fb = a.full_tensor(), b.full_tensor()
            got = step(a, b, 2.0)
            want = {"mm": fa @ fb * 2.0, "colsum": fa.sum(0), "act": torch.tanh(fa)}
            label = f"mesh={mesh.mesh_dim_names} {tuple(shape_a)} {pa}/{pb}"
            for k in want:
                full = got[k].full_tensor()
                if not torch.allclose(full, want[k], atol=1e-5):
                    problems.append(f"{label} {k}: {full.flatten()[:4].tolist()} != {want[k].flatten()[:4].tolist()}")
    # out_placements pins output shardings, also for uneven outputs.
    mesh = meshes[0]
    pinned = spmd(lambda a: a[:5] * 3, out_placements=[Shard(0)] * mesh.ndim)
    a = _make(_full((8, 3), torch.float32, seed=5), mesh, [Shard(0)] * mesh.ndim)
    out = pinned(a)
    if out.placements != (Shard(0),) * mesh.ndim or not torch.equal(out.full_tensor(), a.full_tensor()[:5] * 3):
        problems.append(f"out_placements: got {out.placements} {out.full_tensor().tolist()}")
    return problems


def case_divergent(world):
    """Rank-divergent code between SPMD calls: results stay right, or errors name the ranks."""
    from torch.distributed.tensor import Replicate, Shard
    import jax

    from tpudist.sharding import AgreementTimeout, Path, PlanMismatch, path_counts, redistribute, spmd

    rank = torch.distributed.get_rank()
    problems = []
    mesh = _mesh((world,), ("div",))
    x = _make(_full((8, 4), torch.float32, seed=7), mesh, [Shard(0)])
    want = x.redistribute(mesh, [Replicate()])
    # (a) rank 0 logs and does rank-local JAX work; with 4 ranks the tp group of rank 0 also evaluates
    # with extra SPMD calls on its sub-mesh that the other group never makes.
    grid = _mesh((2, 2), ("dp2", "tp2")) if world == 4 else None
    for step in range(3):
        if rank == 0:
            print(f"step {step}: local sum {x.to_local().sum().item()}")
            _ = jax.numpy.ones(3).sum()
        if grid is not None and grid.get_coordinate()[0] == 0:
            sub = grid["tp2"]
            e = _make(_full((4, 2), torch.float32, seed=step), sub, [Shard(0)])
            evaluated = spmd(lambda t: t.sum())(e)
            if evaluated.full_tensor().item() != e.full_tensor().sum().item():
                problems.append(f"(a) eval step {step}: {evaluated.full_tensor()}")
            _same(f"(a) sub-mesh redistribute step {step}", redistribute(e, [Replicate()]),
                  e.redistribute(sub, [Replicate()]), problems)
        _same(f"(a) step {step}", redistribute(x, [Replicate()]), want, problems)
        if grid is not None:
            g = _make(_full((4, 4), torch.float32, seed=step), grid, [Shard(0), Shard(1)])
            _same(f"(a) grid step {step}", redistribute(g, [Replicate(), Shard(0)]),
                  g.redistribute(grid, [Replicate(), Shard(0)]), problems)

    # (b) rank 0 traces a different program (a debug print): MPMD fallback, same values.
    def loss(a):
        if rank == 0:
            jax.debug.print("rank 0 sees {}", a.sum())
        return a * 2

    loss.__qualname__ = "loss"  # the same function on every rank, by meaning
    before = path_counts().get(("spmd", Path.MPMD), 0)
    got = spmd(loss)(x)
    if path_counts().get(("spmd", Path.MPMD), 0) != before + 1:
        problems.append("(b) a rank-divergent program did not take the MPMD path")
    if not torch.equal(got.full_tensor(), x.full_tensor() * 2) or got.placements != (Replicate(),):
        problems.append(f"(b) mpmd fallback: {got.placements} {got.full_tensor().flatten()[:4].tolist()}")
    try:
        spmd(loss, on_mismatch="raise")(x)
        problems.append("(b) on_mismatch='raise' did not raise")
    except PlanMismatch as e:
        if "different compiled programs" not in str(e) or "ranks [0]" not in str(e):
            problems.append(f"(b) message: {e}")
    # (b2) rank 0 compiles under other XLA flags: redistribute falls back to DTensor's collectives.
    import os

    saved = os.environ.get("XLA_FLAGS", "")
    if rank == 0:
        os.environ["XLA_FLAGS"] = saved + " --xla_cpu_enable_fast_math=false"
    try:
        before = path_counts().get(("redistribute", Path.MPMD), 0)
        _same("(b2) mpmd fallback", redistribute(x, [Replicate()]), want, problems)
        if path_counts().get(("redistribute", Path.MPMD), 0) != before + 1:
            problems.append("(b2) differing XLA_FLAGS did not take the MPMD path")
    finally:
        os.environ["XLA_FLAGS"] = saved
    # (b3) an async c10d collective still in flight on the same devices runs before the SPMD program.
    t = torch.full((1 << 16,), float(rank))
    work = torch.distributed.all_reduce(t, async_op=True)
    _same("(b3) after async all_reduce", redistribute(x, [Replicate()]), want, problems)
    work.wait()
    if t[0].item() != sum(range(world)):
        problems.append(f"(b3) async all_reduce gave {t[0].item()}")
    # (c) ranks ask for different redistributions: every rank raises, naming both groups.
    try:
        redistribute(x, [Shard(1)] if rank == 0 else [Replicate()])
        problems.append("(c) different calls did not raise")
    except PlanMismatch as e:
        if "different calls" not in str(e) or "ranks [0]" not in str(e):
            problems.append(f"(c) message: {e}")
    # (c2) only rank 0's input requires grad: it would take DTensor's path alone; caught, not hung.
    g = _make(_full((8, 4), torch.float32, seed=7), mesh, [Shard(0)]).requires_grad_(rank == 0)
    try:
        redistribute(g, [Replicate()])
        problems.append("(c2) different paths did not raise")
    except PlanMismatch as e:
        if "different calls" not in str(e) or "ranks [0]" not in str(e):
            problems.append(f"(c2) message: {e}")
    # still aligned afterwards
    _same("(c) after", redistribute(x, [Replicate()]), want, problems)
    # (d) rank 0 skips a step: the others time out naming it, no hang.
    skip = _mesh((world,), ("skip",))
    y = _make(_full((8, 4), torch.float32, seed=8), skip, [Shard(0)])
    if rank != 0:
        try:
            redistribute(y, [Replicate()], timeout=timedelta(seconds=3))
            problems.append("(d) no timeout")
        except AgreementTimeout as e:
            if "ranks [0] did not reach" not in str(e):
                problems.append(f"(d) message: {e}")
    return problems


def case_strided(world):
    """FSDP2+TP's _StridedShard: to_jax gives P(('tp', 'dp')) and the same global values as DTensor."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tpudist.sharding import jax_mesh, redistribute, to_jax

    mesh = _mesh((2, 2), ("dp", "tp"))
    full = _full((8, 4), torch.float32, seed=9)
    dp, tp = mesh.get_coordinate()
    # right-to-left: split by tp first, then dp (the _StridedShard docstring's table)
    local = full.chunk(2, 0)[tp].chunk(2, 0)[dp].clone()
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    x = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    problems = []
    if not torch.equal(x.full_tensor(), full):
        problems.append("DTensor's own view of the strided layout differs from the docstring")
    arr = to_jax(x)
    if arr.sharding.spec != PartitionSpec(("tp", "dp"), None):
        problems.append(f"spec {arr.sharding.spec}")
    gathered = jax.jit(lambda a: a, out_shardings=NamedSharding(jax_mesh(mesh), PartitionSpec()))(arr)
    if not np.array_equal(np.asarray(gathered.addressable_data(0)), full.numpy()):
        problems.append("to_jax global values differ from the full tensor")
    _same("strided -> replicate", redistribute(x, [Replicate(), Replicate()]),
          x.redistribute(mesh, [Replicate(), Replicate()]), problems)
    return problems


# -- driver side --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request):
    with RankPool(request.param, backend="tpu", timeout=240) as p:
        yield p


def _check(results):
    problems = [p for rank_problems in results for p in rank_problems]
    assert not problems, "\n".join(problems[:20])


def test_to_jax_from_jax_round_trip(pool):
    _check(pool.run(case_roundtrip, pool.world_size))


def test_redistribute_equals_dtensor(pool):
    num_pairs = 16 if pool.world_size == 2 else 10
    _check(pool.run(case_redistribute, pool.world_size, [(4, 6), (5, 3)], num_pairs, seed=0))


def test_redistribute_compiles_to_the_tabled_collective(pool):
    found = pool.run(case_compiled_collectives, pool.world_size)[0]
    assert found["S(0)->R"] == ["all-gather"]
    assert "all-reduce" in found["P(sum)->R"]
    assert set(found["P(sum)->S(0)"]) & {"reduce-scatter", "all-reduce"}
    assert found["S(0)->S(1)"] == ["all-to-all"]
    assert found["R->S(0)"] == []


def test_spmd_equals_fn_on_full_tensors(pool):
    _check(pool.run(case_spmd, pool.world_size))


def test_divergent_ranks_stay_correct_or_raise(pool):
    _check(pool.run(case_divergent, pool.world_size))


def test_strided_shard(pool):
    if pool.world_size != 4:
        pytest.skip("needs a 2x2 mesh")
    _check(pool.run(case_strided, pool.world_size))
