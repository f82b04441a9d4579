"""Rank-side code of test_gloo_parity.py: the forms issue 12 found missing or wrong on "tpu"
(all_gather_coalesced's layout, recv from any source, sparse all_reduce), each run on a "tpu"
group and a gloo group of the same ranks with the same inputs; results are returned for the test
to compare."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_groups: dict = {}


def pair(spec):
    """(tpu group, gloo group) over ``spec`` (None: the world), created once on every rank."""
    if not _groups:
        n = dist.get_world_size()
        for s in (None, (0, n - 1), (n - 1, 0, 1)):
            tpu = dist.group.WORLD if s is None else dist.new_group(list(s))
            gloo = dist.new_group(list(s or range(n)), backend="gloo")
            _groups[s] = (tpu, gloo)
    return _groups[spec]


def member(spec) -> bool:
    pair(spec)
    return spec is None or dist.get_rank() in spec


# -- all_gather_coalesced: output_tensor_lists[rank][i] ----------------------------------------
def all_gather_coalesced(spec, use_async: bool):
    if not member(spec):
        return None
    results = []
    for g in pair(spec):
        me, n = dist.get_rank(g), dist.get_world_size(g)
        got = {}
        for dtype in (torch.float32, torch.int64, torch.bool, torch.complex64):
            shapes = [(2, 2), (1,), (3,), (0,)]
            inputs = [_make(shape, dtype, 10 * k + me) for k, shape in enumerate(shapes)]
            outs = [[torch.full(s, 7, dtype=dtype) if dtype != torch.bool else torch.zeros(s, dtype=dtype)
                     for s in shapes] for _ in range(n)]
            work = dist.all_gather_coalesced(outs, inputs, group=g, async_op=use_async)
            if use_async:
                work.wait()
            got[str(dtype)] = outs
        results.append(got)
    return results


def _make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


# -- sparse all_reduce --------------------------------------------------------------------------
SPARSE_CASES = [
    # name, dense shape, sparse_dim, dtype, density
    ("matrix", (6, 5), 2, torch.float32, 0.3),
    ("hybrid", (7, 3, 2), 1, torch.float64, 0.4),
    ("vector_int", (9,), 1, torch.int64, 0.5),
    ("empty_on_rank0", (4, 4), 2, torch.float32, 0.5),
    ("uncoalesced", (5, 5), 2, torch.float32, 0.0),
    ("all_empty", (3, 3), 2, torch.float32, 0.0),
]


def _sparse_input(name, shape, sparse_dim, dtype, density, rank):
    g = torch.Generator().manual_seed(100 + rank)
    if name == "uncoalesced":  # duplicate indices, not coalesced: summed as gloo does
        idx = torch.tensor([[0, 1, 0, 4, 1], [2, 3, 2, 0, 3]])
        return torch.sparse_coo_tensor(idx, torch.randn(5, generator=g) + rank, shape)
    dense = torch.randn(shape, generator=g) * 10
    dense = dense * (torch.rand(shape, generator=g) < density)
    if name == "empty_on_rank0" and rank == 0:
        dense = torch.zeros(shape)
    return dense.to(dtype).to_sparse(sparse_dim)


def sparse_all_reduce(spec, use_async: bool):
    if not member(spec):
        return None
    results = []
    for g in pair(spec):
        me = dist.get_rank(g)
        got = {}
        for name, shape, sparse_dim, dtype, density in SPARSE_CASES:
            t = _sparse_input(name, shape, sparse_dim, dtype, density, me)
            work = dist.all_reduce(t, group=g, async_op=use_async)
            if use_async:
                work.wait()
            got[name] = (t.indices().clone(), t.values().clone(), tuple(t.shape), t.is_coalesced())
        results.append(got)
    return results


def sparse_mismatch():
    """Ranks pass sparse tensors of different sizes: every rank raises, naming each rank's size."""
    out = []
    for g in pair(None):
        shape = (4, 4) if dist.get_rank() == 0 else (4, 5)
        try:
            dist.all_reduce(torch.zeros(shape).to_sparse(), group=g)
            out.append("no error")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    out.append(_still_works(pair(None)[0]))
    return out


def _still_works(group):
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    return t.tolist()


# -- recv from any source -----------------------------------------------------------------------
def _profiler(kind):
    if kind == "autograd":
        return torch.autograd.profiler.profile(record_shapes=True)
    if kind == "torch":
        return torch.profiler.profile(record_shapes=True)
    return contextlib.nullcontext()


def recv_any_source(spec, profiler, tag: int):
    """Every rank in turn receives from any source (recv and irecv), the others send it twice; as
    torch's own test_send_recv_any_source, under no profiler, the autograd or the torch profiler."""
    if not member(spec):
        return None
    results = []
    for g in pair(spec):
        me, n = dist.get_rank(g), dist.get_world_size(g)
        me_global = dist.get_rank()
        received = []
        with _profiler(profiler):
            for dst in range(n):
                if dst == me:
                    for _ in range(n - 1):
                        for kind in ("recv", "irecv"):
                            out = torch.full((10,), -1.0)
                            if kind == "recv":
                                sender = dist.recv(out, group=g, tag=tag)  # a global rank
                            else:
                                work = dist.irecv(out, group=g, tag=tag)
                                work.wait()
                                sender = dist.get_global_rank(g, work._source_rank())
                            received.append((sender, out.tolist()))
                else:
                    payload = torch.full((10,), float(me_global)) + torch.arange(10.0) / 16
                    dist.send(payload, group_dst=dst, group=g, tag=tag)
                    dist.send(payload, group_dst=dst, group=g, tag=tag)
        results.append(sorted(received))
    return results


def recv_any_source_timeout():
    """Nobody sends: the any-source recv raises within the group timeout instead of hanging."""
    group = dist.new_group(timeout=timedelta(seconds=2))
    if dist.get_rank() != 0:
        time.sleep(4)
        return "sender idle"
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(3), group=group)
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"


# -- a barrier that times out on one rank (run as a script: the exit code is the point) ---------
def barrier_timeout_main(backend: str, rendezvous: str, first_world_timeout_s: float) -> None:
    """Rank 0 alone enters a barrier of a group whose timeout is 1 s; it must raise, and then both
    ranks destroy the group and exit 0. ``first_world_timeout_s`` > 0: a world with that timeout
    runs first in the same process (XLA keeps the first world's collective timeout), and rank 1
    does not wait for rank 0 before destroying."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if first_world_timeout_s > 0:
        dist.init_process_group(backend, init_method=f"file://{rendezvous}/first", rank=rank,
                                world_size=world, timeout=timedelta(seconds=first_world_timeout_s))
        dist.barrier()
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{rendezvous}/second", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1))
    # Every rank is through init before any destroys: gloo's init connects the full mesh within the
    # group's 1 s, and a peer that had already destroyed made rank 0's connect fail on a loaded
    # machine ("connectFullMesh failed": the reference run, not what this test is about).
    _wait_for_all(f"{rendezvous}/inited", rank, world)
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier()
            print("RESULT no error", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"RESULT raised {type(e).__name__} after {time.monotonic() - start:.2f}s: {e}",
                  flush=True)
    # After a longer first world, rank 1 goes straight to destroy: it waits in JAX's shutdown
    # barrier while rank 0's barrier is still inside XLA (until XLA's timeout, the first world's).
    if first_world_timeout_s == 0:
        _wait_for_all(f"{rendezvous}/done", rank, world)
    dist.destroy_process_group()
    print("RESULT destroyed", flush=True)


def _wait_for_all(prefix: str, rank: int, world: int, timeout_s: float = 120) -> None:
    """Marks this rank at ``prefix`` and waits until every rank has (exit 3 after ``timeout_s``)."""
    open(f"{prefix}{rank}", "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(f"{prefix}{r}") for r in range(world)):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)


if __name__ == "__main__":
    barrier_timeout_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
