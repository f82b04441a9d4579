"""Rank-side functions of tests/device/test_device_p2p.py: point to point and pipelines on "tpu" tensors.

Each function imports ``tpudist.device`` itself (the pytest process never does). A case runs twice
on the same two ranks: on tpu tensors over the "tpu" process groups, and on CPU tensors over gloo
groups made here (the reference); the test compares what the ranks return (CPU tensors).
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64)
_GLOO: dict[tuple[int, ...], object] = {}  # gloo groups of this rank process, made once


def gloo_group(ranks: tuple[int, ...] | None = None):
    """A gloo group over ``ranks`` (default: the world), made on first use and kept."""
    ranks = tuple(range(dist.get_world_size())) if ranks is None else ranks
    if ranks not in _GLOO:
        _GLOO[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _GLOO[ranks]


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values that show a wrong byte: random bits across the dtype's range; floats with -0.0, inf, nan."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.float64 if dtype == torch.complex64 else dtype
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1000).to(real)
        flat = t.view(-1)
        flat[:3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=torch.float64).to(real)[:flat.numel()]
        if dtype == torch.complex64:
            t = torch.complex(t.float(), -t.float().flip(-1))
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def exchange(device: str) -> dict:
    """Every form of point to point between the two ranks on ``device`` tensors: blocking, any
    source, async, batched, tags, a subgroup, views and strided tensors, every dtype, sizes past
    the envelope and zero. The received tensors (and the bases of received views) on the CPU."""
    import tpudist.device  # noqa: F401

    r = dist.get_rank()
    peer = 1 - r
    group = gloo_group() if device == "cpu" else None
    T = lambda t: t.to(device)  # noqa: E731
    out: dict = {}

    def send(x, dst):
        dist.send(x if device == "tpu" else x.contiguous(), dst, group=group)  # gloo: contiguous only

    def recv(into, src):
        if device == "tpu" or into.is_contiguous():
            return dist.recv(into, src, group=group)
        dense = torch.empty_like(into, memory_format=torch.contiguous_format)  # gloo: via a copy
        dist.recv(dense, src, group=group)
        into.copy_(dense)

    def send_then_recv(name, x, like):
        """Rank 0 sends first, rank 1 receives first: each rank receives the other's ``x``."""
        got = T(torch.zeros_like(like))
        if r == 0:
            send(x, peer)
            recv(got, peer)
        else:
            recv(got, peer)
            send(x, peer)
        out[name] = got

    for i, dtype in enumerate(DTYPES):
        x = T(values(dtype, (3, 5), seed=10 * i + r))
        send_then_recv(f"dtype_{dtype}", x, x)
    big = T(values(torch.float32, (3000,), seed=7 + r))  # 12 KB: past the envelope's 4 KiB payload
    send_then_recv("past_envelope", big, big)
    send_then_recv("empty", T(torch.zeros(0, 3)), torch.zeros(0, 3))

    m = T(values(torch.float32, (4, 6), seed=20 + r))
    send_then_recv("send_transposed", m.t(), torch.zeros(6, 4))
    send_then_recv("send_strided", m[:, ::2], torch.zeros(4, 3))
    i64 = T(values(torch.int64, (4, 6), seed=30 + r))
    send_then_recv("send_strided_int64", i64[1:, 1::2], torch.zeros(3, 3, dtype=torch.int64))

    base = T(torch.full((4, 6), -1.0))  # recvs into views of one storage write that storage
    col, block = base[:, 1], base[1:3, 2:5]
    data = T(torch.arange(10.0) + 100 * r)
    if r == 0:
        send(data[:4], peer)
        send(data[4:].view(2, 3), peer)
        recv(col, peer)
        recv(block, peer)
    else:
        recv(col, peer)
        recv(block, peer)
        send(data[:4], peer)
        send(data[4:].view(2, 3), peer)
    out["recv_into_views_base"] = base

    # isend/irecv both ways at once, and a collective between posting and waiting
    x, got = T(values(torch.float32, (5,), seed=40 + r)), T(torch.zeros(5))
    works = [dist.isend(x, peer, group=group), dist.irecv(got, peer, group=group)]
    s = T(torch.ones(2) * (r + 1))
    dist.all_reduce(s, group=group)
    for w in works:
        w.wait()
    out["isend_irecv"], out["all_reduce_between"] = got, s

    # batch_isend_irecv: two messages each way, told apart by their tags (posted in opposite orders)
    a, b = T(values(torch.float32, (3,), seed=50 + r)), T(values(torch.int32, (2,), seed=60 + r))
    got_a, got_b = T(torch.zeros(3)), T(torch.zeros(2, dtype=torch.int32))
    ops = [dist.P2POp(dist.isend, a, peer, group, tag=1), dist.P2POp(dist.isend, b, peer, group, tag=2)]
    recvs = [dist.P2POp(dist.irecv, got_b, peer, group, tag=2), dist.P2POp(dist.irecv, got_a, peer, group, tag=1)]
    for w in dist.batch_isend_irecv(ops + recvs if r == 0 else recvs + ops):
        w.wait()
    out["batch_tag1"], out["batch_tag2"] = got_a, got_b

    # tags with plain isend/irecv: the receiver asks for tag 2 first
    x1, x2 = T(torch.full((2,), 1.0 + r)), T(torch.full((2,), 2.0 + r))
    if r == 0:
        works = [dist.isend(x1, 1, group=group, tag=1), dist.isend(x2, 1, group=group, tag=2)]
    else:
        y1, y2 = T(torch.zeros(2)), T(torch.zeros(2))
        works = [dist.irecv(y2, 0, group=group, tag=2), dist.irecv(y1, 0, group=group, tag=1)]
        out["tag1"], out["tag2"] = y1, y2
    for w in works:
        w.wait()

    # recv from any source (blocking and async): the sender's rank comes back
    x = T(torch.arange(4, dtype=torch.float64) + 10 * r)
    if r == 1:
        dist.send(x, 0, group=group)
        dist.send(x * 2, 0, group=group)
    else:
        y, z = T(torch.zeros(4, dtype=torch.float64)), T(torch.zeros(4, dtype=torch.float64))
        out["any_source_rank"] = dist.recv(y, group=group)
        w = dist.irecv(z, group=group)
        w.wait()
        out["any_source"], out["any_source_async"] = y, z

    # a subgroup (both ranks, in reverse order: group ranks differ from global ranks)
    sub = dist.new_group([1, 0], backend="gloo" if device == "cpu" else None)
    x, y = T(torch.arange(3.0) + 5 * r), T(torch.zeros(3))
    me = dist.get_group_rank(sub, r)
    works = [dist.isend(x, group=sub, group_dst=1 - me), dist.irecv(y, group=sub, group_src=1 - me)]
    for w in works:
        w.wait()
    out["subgroup"] = y
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def mismatches() -> dict:
    """Sender and receiver that disagree (element count, dtype, device), and bad calls; then the
    group still works. The errors as text."""
    import tpudist.device  # noqa: F401

    r, peer = dist.get_rank(), 1 - dist.get_rank()
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors[name] = f"{type(e).__name__}: {e}"

    def pair(send, recv):
        return lambda: dist.send(send, peer) if r == 0 else dist.recv(recv, peer)

    tpu = lambda *a, **k: torch.ones(*a, **k, device="tpu")  # noqa: E731
    attempt("numel", pair(tpu(3), tpu(4)))
    attempt("dtype", pair(tpu(3), tpu(3, dtype=torch.int32)))
    attempt("device", pair(tpu(3), torch.ones(3)))
    attempt("async_numel", lambda: dist.isend(tpu(2, 3), peer).wait() if r == 0
            else dist.irecv(tpu(3, 3), peer).wait())
    attempt("expanded_recv", lambda: dist.irecv(tpu(1).expand(3), peer))
    quick = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    attempt("no_receiver", lambda: dist.send(tpu(2), peer, group=quick))  # both send: nobody receives
    t = tpu(2)
    dist.all_reduce(t)
    errors["after_all_reduce"] = t.cpu().tolist()
    x, y = torch.full((2,), 5.0 + r, device="tpu"), tpu(2)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
        w.wait()
    errors["after_p2p"] = y.cpu().tolist()
    return errors


_CONVERSIONS = {  # module -> names: every way a tensor's data reaches the host on the collective paths
    "tpudist.process_group.tensors": ("as_numeric", "as_bytes", "raw", "write_raw", "write_numeric",
                                      "write_bytes", "_copy_into"),
    "tpudist.device._storage": ("to_torch", "to_jax", "to_cpu", "from_cpu"),
}


def no_host_copy(sabotage: bool = False) -> dict:
    """Sends and recvs of tpu tensors, watched: host conversions and ``jax.device_get`` are counted,
    and the buffers are followed from the sender's storage through the read and collective
    programs, and from the collective's output through the receiver's write program into its
    storage.

    ``sabotage``: the pieces take a detour through host memory into the collective program (what a
    host copy would do); the check must see it.
    """
    import importlib

    import jax
    import numpy as np

    import tpudist.device  # noqa: F401
    from tpudist.device import _storage
    from tpudist.process_group import device_arrays

    counts: dict[str, int] = {}
    fetched: list[int] = []  # sizes of the arrays jax.device_get brought to the host
    saved = []

    def watch(owner, name, wrapper_of):
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, wrapper_of(original))

    def counting(name):
        def wrapper_of(original):
            def wrapper(*args, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                return original(*args, **kwargs)
            return wrapper
        return wrapper_of

    for module_name, names in _CONVERSIONS.items():
        module = importlib.import_module(module_name)
        for name in names:
            watch(module, name, counting(name))

    def fetching(original):
        def wrapper(x, *args, **kwargs):
            fetched.extend(int(np.size(a)) for a in jax.tree_util.tree_leaves(x))
            return original(x, *args, **kwargs)
        return wrapper

    watch(jax, "device_get", fetching)

    def pointers(arrays):
        return [(a.addressable_data(0) if len(a.sharding.device_set) > 1 else a).unsafe_buffer_pointer()
                for a in arrays]

    stages = []

    seen = []  # every array the programs took and made, kept alive: a freed buffer's address is reused

    def watched(original):
        def run(stage, fn, *args):
            result = original(stage, fn, *args)
            seen.append((args, result))
            if stage == "read":
                stages.append((stage, pointers(args[0]), pointers(result[1])))
            elif stage == "permute":  # a whole storage: the transfer's one program
                stages.append((stage, pointers(args), pointers(result)))
            elif stage == "collective":
                stages.append((stage, pointers(args[1:]), pointers(result[0])))
            else:
                stages.append((stage, pointers(args[2]), pointers(result)))
            return result
        return run

    watch(device_arrays, "execute", watched)
    if sabotage:
        watch(device_arrays, "_put", lambda original: lambda aval, sharding, local, device: original(
            aval, sharding, np.array(local), device))

    r, peer = dist.get_rank(), 1 - dist.get_rank()
    checks, host, direct = [], {}, []  # direct: the checks whose transfers were one program each
    storage_pointer = lambda t: _storage.buffer_of(t).value.unsafe_buffer_pointer()  # noqa: E731

    def check(name, run, sent, received):
        """A whole storage: the sender's storage is the permute program's input, its output the
        receiver's storage. A view: the sender's storage is the read program's input, its pieces
        the collective's input; the collective's output is the write program's input, whose
        output is the receiver's storage."""
        before = {storage_pointer(t) for t in sent}
        start, counted = len(stages), dict(counts)
        run()
        calls, i = [], start
        while i < len(stages):
            width = 1 if stages[i][0] == "permute" else 3
            calls.append(stages[i:i + width])
            i += width
        assert all([s for s, _, _ in c] in (["permute"], ["read", "collective", "write"]) for c in calls), calls
        links = []
        if sent:
            whole = [c for c in calls if c[0][0] == "permute" and before <= set(c[0][1])]
            if whole:  # the sender's storage goes into the permute as it is
                links += [len(whole) == 1]
            else:  # the sender's storage is read, and the pieces go into the collective unchanged
                reads = [c for c in calls if len(c) == 3 and set(c[0][1]) == before and c[2][2] == []]
                links += [len(reads) == 1, bool(reads) and reads[0][1][1] == reads[0][0][2]]
        if received:  # the transfer's output becomes the receiver's storage
            after = {storage_pointer(t) for t in received}
            mine = [c for c in calls if set(c[-1][2]) == after]
            if mine and len(mine[0]) == 3:  # through the write program
                links += [len(mine) == 1, mine[0][2][1] == mine[0][1][2]]
            else:
                links += [len(mine) == 1]
        checks.append((name, links))
        if calls and all(c[0][0] == "permute" for c in calls):
            direct.append(name)
        for key, value in counts.items():
            host[key] = host.get(key, 0) + value - counted.get(key, 0)

    results = {}
    try:
        x = (torch.arange(6.0) * (r + 1)).to("tpu")
        y = torch.zeros(6).to("tpu")
        if r == 0:
            check("send", lambda: dist.send(x, 1), [x], [])
            check("recv", lambda: dist.recv(y, 1), [], [y])
        else:
            check("recv", lambda: dist.recv(y, 0), [], [y])
            check("send", lambda: dist.send(x, 0), [x], [])
        results["recv"] = y
        big, got = (torch.arange(3000.0) + r).to("tpu"), torch.zeros(3000).to("tpu")
        base = torch.zeros(4, 3).to("tpu")
        view = base[:, 1]

        def both():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, got, peer)]):
                w.wait()

        src = (torch.arange(4.0) + 10 * r).to("tpu")

        def into_view():
            works = [dist.isend(src, peer), dist.irecv(view, peer)]
            for w in works:
                w.wait()

        check("batch_isend_irecv", both, [big], [got])
        results["batch"] = got
        check("irecv_into_view", into_view, [], [base])
        results["view_base"] = base
        fetched_p2p = list(fetched)
        dist.send(torch.ones(2), peer) if r == 0 else dist.recv(torch.zeros(2), peer)  # controls
        x.cpu()
        controls = dict(counts)
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    return {"checks": checks, "direct": direct, "host_conversions": host, "controls": controls, "fetched": fetched_p2p,
            "results": {k: v.cpu() for k, v in results.items()}}


# -- pipelines -----------------------------------------------------------------------------------------

WIDTH, BATCH, MICROBATCHES, PIPE_STEPS = 8, 8, 4, 2


def _stage_ids(schedule: str, rank: int, world: int, per_rank: int) -> list[int]:
    """The stages a rank holds: looped (rank r: r, r + world, ...), or V-shaped for ZBV (r, 2w-1-r)."""
    if schedule == "ScheduleZBVZeroBubble":
        return [rank, 2 * world - 1 - rank]
    return [rank + world * k for k in range(per_rank)]


def pipeline(schedule: str, device: str, mode: str = "strict", per_rank: int = 1) -> dict:
    """PIPE_STEPS SGD steps of a stack of Linear+Tanh blocks split into ``world * per_rank`` pipeline
    stages, with ``schedule`` (a class of torch.distributed.pipelining) over MICROBATCHES
    microbatches: on tpu tensors over the "tpu" group, or on CPU tensors over gloo. Returns the
    losses of the rank holding the last stage, and the gradients of the last step and the
    parameters afterwards of this rank's stages (on the CPU)."""
    import tpudist.device  # noqa: F401
    from torch.distributed import pipelining

    r, world = dist.get_rank(), dist.get_world_size()
    num_stages = world * per_rank
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(num_stages)]
    x, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    ids = _stage_ids(schedule, r, world, per_rank)
    group = gloo_group() if device == "cpu" else None
    dev = torch.device(device)
    stages = [pipelining.PipelineStage(blocks[i].to(dev), i, num_stages, dev, group=group) for i in ids]
    cls = getattr(pipelining, schedule)
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], n_microbatches=MICROBATCHES,
                loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    params = [p for i in ids for p in blocks[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    losses = []
    with torch.tpu.eager_mode(mode) if device == "tpu" else contextlib.nullcontext():
        for _ in range(PIPE_STEPS):
            opt.zero_grad()
            args = (x.to(dev),) if 0 in ids else ()
            kwargs = {"target": target.to(dev), "losses": []} if num_stages - 1 in ids else {}
            sched.step(*args, **kwargs)
            losses += [float(v) for v in kwargs.get("losses", [])]
            grads = {f"{i}.{n}": p.grad.cpu() for i in ids for n, p in blocks[i].named_parameters()}
            opt.step()
    return {"losses": losses, "grads": grads, "stages": ids,
            "params": {f"{i}.{n}": p.detach().cpu() for i in ids for n, p in blocks[i].named_parameters()},
            "devices": sorted({str(p.device) for p in params})}


def mpmd(device: str) -> dict:
    """Ranks that run different code between collectives, on ``device`` tensors: rank 0 and 1
    evaluate with an all_reduce on their subgroup (and rank 0 a broadcast on it) while the others
    go straight on to the next world collective; sends between the ranks of the eval group are
    interleaved. The results on the CPU."""
    import tpudist.device  # noqa: F401

    r, n = dist.get_rank(), dist.get_world_size()
    backend = "gloo" if device == "cpu" else None
    world = gloo_group() if device == "cpu" else None
    evals = dist.new_group([0, 1], backend=backend)
    T = lambda t: t.to(device)  # noqa: E731
    out = {}
    for step in range(2):
        g = T(torch.arange(4.0) * (r + 1) + step)
        dist.all_reduce(g, group=world)  # every rank: the "gradient" all_reduce
        out[f"grad{step}"] = g
        if r in (0, 1):  # only the eval ranks: other ranks are already waiting in the next all_reduce
            metric = T(torch.tensor([float(r + step), 1.0], dtype=torch.float64))
            dist.all_reduce(metric, group=evals)
            x = T(torch.full((3,), 10.0 * r + step))
            w = dist.isend(x, 1 - r, group=evals) if r == 0 else dist.irecv(x, 0, group=evals)
            w.wait()
            flag = T(torch.tensor([step + 7], dtype=torch.int32) if r == 0 else torch.zeros(1, dtype=torch.int32))
            dist.broadcast(flag, src=0, group=evals)
            out[f"eval{step}"], out[f"p2p{step}"], out[f"flag{step}"] = metric, x, flag
        c = T(torch.tensor([float(r)]))
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=world)
        out[f"max{step}"] = c
    z = T(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (r + 1))
    dist.all_reduce(z, group=world)  # c10d hands complex tensors over as view_as_real views
    out["complex_all_reduce"] = z
    return {k: v.cpu() for k, v in out.items()}
