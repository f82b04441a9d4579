"""Rank-side code of the collective tests: every case runs on the "tpu" group and on a gloo group
of the same ranks with the same inputs, and reports the differences."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from tpudist.process_group import programs
from tpudist.process_group.group import ProcessGroupTPU

R = dist.ReduceOp
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
SHAPES = [(), (0,), (5,), (3, 7)]
# Every new (op, shape, dtype) compiles a program (~0.1-0.4 s): the full dtype x op product runs on
# one uneven, non-contiguous shape, the edge shapes on a few dtypes.
EDGE_DTYPES = [torch.float32, torch.int64, torch.bool]


def matrix(ops, dtypes):
    main = [(op, dt, (3, 7)) for op in ops for dt in dtypes]
    edges = [(op, dt, shape) for op in ops[:2] for dt in EDGE_DTYPES if dt in dtypes
             for shape in SHAPES[:3]]
    return main + edges
_groups: dict = {}
_GLOO_REFUSES = (torch.int16,)


def groups(ranks: tuple[int, ...] | None):
    """(tpu group, gloo group) over ``ranks`` (None: the world); created once, in the same order
    on every rank (new_group is collective over the world)."""
    if not _groups:
        n = dist.get_world_size()
        for spec in _subgroup_specs(n):
            tpu = dist.new_group(list(spec)) if spec else dist.group.WORLD
            gloo = dist.new_group(list(spec or range(n)), backend="gloo")
            _groups[spec] = (tpu, gloo)
    return _groups[ranks]


def _subgroup_specs(n: int):
    specs = [None, (0, n - 1)]
    if n >= 4:
        specs += [(1, 2, 3), (0, 1, 2), (3, 1)]  # overlapping, and not in rank order
    return specs


def subgroup_specs() -> list:
    return _subgroup_specs(dist.get_world_size())


def member(spec) -> bool:
    groups(spec)  # the first case a pool runs creates every group, on every rank (it is collective)
    return spec is None or dist.get_rank() in spec


def on_path(small: bool, fn, *args):
    """Runs ``fn`` with the envelope path for small collectives on or off (every rank alike)."""
    with programs.small_collectives(small):
        return fn(*args)


def make(shape, dtype, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + (dist.get_rank() if rank is None else rank))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randint(-3, 4, (*shape, 2), generator=g).to(torch.float64).view(
            torch.complex128).reshape(shape).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (a transposed 2-D view)."""
    if t.dim() != 2:
        return t
    return t.t().contiguous().t()


def same(a, b, dtype) -> str | None:
    try:
        if dtype in (torch.float16, torch.bfloat16):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
        elif dtype.is_floating_point or dtype.is_complex:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b), f"{a} != {b}"
    except AssertionError as e:
        return str(e)[:300]
    return None


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _count_calls(cls, name: str) -> list[int]:
    """Counts calls of ``cls.name`` in this rank process from now on: ``[calls]``."""
    method = getattr(cls, name)
    counter = getattr(method, "calls", None)
    if counter is None:
        counter = [0]

        def counted(*args, **kwargs):
            counter[0] += 1
            return method(*args, **kwargs)

        counted.calls = counter
        setattr(cls, name, counted)
    return counter


def run_both(label, fn, outputs_of, dtype, problems, reference=None) -> str:
    """Runs ``fn(group)`` on tpu and gloo; both must raise or both match. Where gloo refuses a
    dtype that tpu supports, ``reference()`` (computed from every rank's known inputs) decides.
    Returns how tpu's call ended ("ok" or "err")."""
    results = []
    for backend_index in (0, 1):
        try:
            results.append(("ok", outputs_of(fn(backend_index))))
        except Exception as e:  # noqa: BLE001 - a raised error is a result to compare
            results.append(("err", f"{type(e).__name__}: {e}"[:200], traceback.format_exc()))
    (s_tpu, v_tpu, *_), (s_gloo, v_gloo, *_) = results
    if s_tpu == "err" and s_gloo == "err":
        return s_tpu
    if s_tpu == "ok" and s_gloo == "err" and reference is not None:
        s_gloo, v_gloo = "ok", reference()
    if s_tpu == "ok" and s_gloo == "err" and dtype in _GLOO_REFUSES and "Invalid scalar type" in v_gloo:
        # Data-moving ops run on raw bytes whatever the dtype, so the float16 case (same size)
        # covers int16's path; gloo has no int16 kernels to compare against.
        return s_tpu
    if s_tpu != s_gloo:
        problems.append(f"{label}: tpu {s_tpu} {v_tpu if s_tpu == 'err' else ''} vs gloo {s_gloo} "
                        f"{v_gloo if s_gloo == 'err' else ''}")
        return s_tpu
    for a, b in zip(v_tpu, v_gloo, strict=True):
        diff = same(a, b, dtype)
        if diff:
            problems.append(f"{label}: {diff}")
            break
    return s_tpu


def _fold(tensors, op: str, n: int):
    """Reference reduction of per-rank tensors (used where gloo refuses a dtype/op pair)."""
    stack = torch.stack([t.to(torch.float64) if t.dtype in (torch.float16, torch.bfloat16) else t
                         for t in tensors])
    if op in ("SUM", "AVG"):
        out = stack.any(0) if stack.dtype == torch.bool else stack.sum(0)
        out = out / n if op == "AVG" else out
    elif op == "PRODUCT":
        out = stack.all(0) if stack.dtype == torch.bool else stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = tensors[0]
        for t in tensors[1:]:
            out = fn(out, t)
    return out.to(tensors[0].dtype)


def case_all_reduce(spec, reduce_ops=REDUCE_OPS, dtypes=DTYPES):
    problems = []
    if not member(spec):
        return problems
    pair = groups(spec)
    n = dist.get_world_size(pair[0])
    # Contiguous inputs take the flat path of small all_reduces (small.py) where the envelope is on.
    layouts = [noncontig, _as_is] if programs.small_enabled() else [noncontig]
    flat_calls = _count_calls(ProcessGroupTPU, "_run_small")
    for seed, (op, dtype, shape) in enumerate(matrix(reduce_ops, dtypes)):
        for layout in layouts:
            inputs = [layout(make(shape, dtype, seed)), layout(make(shape, dtype, seed))]

            def fn(i, op=op, inputs=inputs):
                dist.all_reduce(inputs[i], getattr(R, op), group=pair[i])
                return inputs[i]

            def reference(op=op, dtype=dtype, shape=shape, seed=seed):
                ranks = spec or range(dist.get_world_size())
                return [_fold([make(shape, dtype, seed, rank=r) for r in ranks], op, len(ranks))]

            label = f"all_reduce {op} {dtype} {shape} {layout.__name__}"
            before = flat_calls[0]
            outcome = run_both(label, fn, lambda t: [t], dtype, problems, reference)
            flat = flat_calls[0] > before
            if layout is _as_is and flat != (outcome == "ok" and dtype != torch.bool):
                problems.append(f"{label}: tpu {outcome}, {'took' if flat else 'did not take'} the flat path")
    # PREMUL_SUM: gloo refuses it; the reference is factor * SUM on gloo.
    for seed, dtype in enumerate([torch.float32, torch.bfloat16, torch.float64]):
        t, ref = make((6,), dtype, seed), make((6,), dtype, seed)
        dist.all_reduce(t, dist._make_nccl_premul_sum(2.5), group=pair[0])
        dist.all_reduce(ref, R.SUM, group=pair[1])
        diff = same(t, (ref.double() * 2.5).to(dtype), dtype)
        if diff:
            problems.append(f"all_reduce PREMUL_SUM {dtype}: {diff}")
    del n
    return problems


def _each_dtype(spec, label, body):
    """Runs ``body(pair, group_rank, n, dtype, seed, problems)`` for every dtype, on members."""
    problems: list[str] = []
    if not member(spec):
        return problems
    pair = groups(spec)
    me, n = dist.get_rank(pair[0]), dist.get_world_size(pair[0])
    for seed, dtype in enumerate(DTYPES):
        try:
            body(pair, me, n, dtype, seed, problems)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{label} {dtype}: {type(e).__name__}: {e}"[:400])
    return problems


def case_broadcast_reduce(spec):
    def body(pair, me, n, dtype, seed, problems):
        for root in (0, n - 1):
            src = dist.get_global_rank(pair[0], root)
            ins = [noncontig(make((3, 5), dtype, seed)) for _ in range(2)]
            if dtype.is_floating_point:
                for t in ins:
                    t[0, 0] = -0.0  # a broadcast must keep the sign of zero
            run_both(f"broadcast root={root} {dtype}",
                     lambda i: (dist.broadcast(ins[i], src, group=pair[i]), ins[i])[1],
                     lambda t: [t], dtype, problems)
            if dtype.is_floating_point and not torch.signbit(ins[0][0, 0]).item():
                problems.append(f"broadcast {dtype}: -0.0 arrived as +0.0")
            red = [make((4,), dtype, seed) for _ in range(2)]
            before = red[0].clone()
            # gloo's reduce aborts the process on complex MAX (torch 2.13 checks only all_reduce)
            rop = "SUM" if dtype.is_complex else "MAX"

            def fn(i, rop=rop):
                dist.reduce(red[i], src, getattr(R, rop), group=pair[i])
                return red[i]

            if me == root:
                run_both(f"reduce dst={root} {dtype}", fn, lambda t: [t], dtype, problems,
                         lambda: [_fold([make((4,), dtype, seed, rank=dist.get_global_rank(pair[0], r))
                                         for r in range(n)], rop, n)])
            else:
                for i in (0, 1):
                    try:
                        fn(i)
                    except Exception as e:  # noqa: BLE001 - gloo refuses some dtypes; root reports it
                        if i == 0:
                            problems.append(f"reduce {dtype} on a non-dst rank: {e}"[:300])
                if not torch.equal(red[0], before):
                    problems.append(f"reduce {dtype}: non-dst rank's tensor was modified")
    return _each_dtype(spec, "broadcast/reduce", body)


def case_all_gather(spec):
    def body(pair, me, n, dtype, seed, problems):
        # even, list form
        inp = noncontig(make((2, 3), dtype, seed))
        run_both(f"all_gather even {dtype}",
                 lambda i: _ag_list(pair[i], inp, [(2, 3)] * n, dtype), lambda o: o, dtype, problems)
        # uneven: rank r contributes r+1 rows (and one rank nothing at all)
        shapes = [(r if r < n - 1 else 0, 3) for r in range(n)] if n > 2 else [(0, 3), (3, 3)]
        mine = make(shapes[me], dtype, seed)
        run_both(f"all_gather uneven {dtype}", lambda i: _ag_list(pair[i], mine, shapes, dtype),
                 lambda o: o, dtype, problems,  # gloo refuses uneven sizes
                 lambda: [make(shapes[r], dtype, seed, rank=dist.get_global_rank(pair[0], r))
                          for r in range(n)])
        # into one tensor, non-contiguous output
        flat = make((3,), dtype, seed)
        outs = [torch.zeros(n * 3 * 2, dtype=dtype)[::2] for _ in range(2)]
        run_both(f"all_gather_single {dtype}",
                 lambda i: (dist.all_gather_single(outs[i], flat, group=pair[i]), outs[i])[1],
                 lambda t: [t], dtype, problems)
        # into one contiguous tensor: the flat path (group.py's _flat_ready)
        dense = [torch.zeros(n * 3, dtype=dtype) for _ in range(2)]
        run_both(f"all_gather_single contiguous {dtype}",
                 lambda i: (dist.all_gather_single(dense[i], flat, group=pair[i]), dense[i])[1],
                 lambda t: [t], dtype, problems)
    return _each_dtype(spec, "all_gather", body)


def _ag_list(group, inp, shapes, dtype):
    outs = [torch.zeros(s, dtype=dtype) for s in shapes]
    dist.all_gather(outs, inp, group=group)
    return outs


def case_reduce_scatter(spec):
    def body(pair, me, n, dtype, seed, problems):
        for op in (["SUM", "MAX"] if dtype != torch.bool else ["SUM"]):
            inp = make((n * 4,), dtype, seed)
            outs = [torch.zeros(4, dtype=dtype) for _ in range(2)]
            ref = lambda op=op: [_fold([make((n * 4,), dtype, seed, rank=dist.get_global_rank(pair[0], r))
                                        for r in range(n)], op, n)[me * 4:(me + 1) * 4]]
            run_both(f"reduce_scatter_single {op} {dtype}",
                     lambda i: (dist.reduce_scatter_single(outs[i], inp, getattr(R, op), group=pair[i]),
                                outs[i])[1], lambda t: [t], dtype, problems, ref)
            chunks = [make((2, 3), dtype, seed + 100 + j) for j in range(n)]
            louts = [torch.zeros((2, 3), dtype=dtype) for _ in range(2)]
            run_both(f"reduce_scatter list {op} {dtype}",
                     lambda i: (dist.reduce_scatter(louts[i], chunks, getattr(R, op), group=pair[i]),
                                louts[i])[1], lambda t: [t], dtype, problems)
    return _each_dtype(spec, "reduce_scatter", body)


def case_all_to_all(spec):
    def body(pair, me, n, dtype, seed, problems):
        inp = make((n * 2, 3), dtype, seed)
        outs = [torch.zeros((n * 2, 3), dtype=dtype) for _ in range(2)]
        run_both(f"all_to_all_single even {dtype}",
                 lambda i: (dist.all_to_all_single(outs[i], inp, group=pair[i]), outs[i])[1],
                 lambda t: [t], dtype, problems)
        # uneven: rank r sends (r + j) % 3 rows to rank j (zero rows included)
        send = [(me + j) % 3 for j in range(n)]
        recv = [(j + me) % 3 for j in range(n)]
        uin = make((sum(send), 2), dtype, seed)
        uouts = [torch.zeros((sum(recv), 2), dtype=dtype) for _ in range(2)]
        run_both(f"all_to_all_single uneven {dtype}",
                 lambda i: (dist.all_to_all_single(uouts[i], uin, recv, send, group=pair[i]), uouts[i])[1],
                 lambda t: [t], dtype, problems)
        # list form with a different shape per pair: rank r sends rank j an (r+1, j+1) tensor
        lin = [make((me + 1, j + 1), dtype, seed + j) for j in range(n)]
        lout = [[torch.zeros((k + 1, me + 1), dtype=dtype) for k in range(n)] for _ in range(2)]
        run_both(f"all_to_all list {dtype}",
                 lambda i: (dist.all_to_all(lout[i], lin, group=pair[i]), lout[i])[1],
                 lambda o: o, dtype, problems,  # gloo refuses uneven sizes
                 lambda: [make((k + 1, me + 1), dtype, seed + me, rank=dist.get_global_rank(pair[0], k))
                          for k in range(n)])
    return _each_dtype(spec, "all_to_all", body)


def case_gather_scatter(spec):
    def body(pair, me, n, dtype, seed, problems):
        for root in (0, n - 1):
            dst = dist.get_global_rank(pair[0], root)
            inp = noncontig(make((3, 2), dtype, seed))
            outs = [[torch.zeros((3, 2), dtype=dtype) for _ in range(n)] if me == root else None
                    for _ in range(2)]
            run_both(f"gather dst={root} {dtype}",
                     lambda i: (dist.gather(inp, outs[i], dst=dst, group=pair[i]), outs[i] or [])[1],
                     lambda o: o, dtype, problems,  # gloo's gather has no complex kernels
                     lambda: [make((3, 2), dtype, seed, rank=dist.get_global_rank(pair[0], r))
                              for r in range(n)] if me == root else [])
            chunks = [make((2, 2), dtype, seed + j) for j in range(n)] if me == root else None
            souts = [torch.zeros((2, 2), dtype=dtype) for _ in range(2)]
            run_both(f"scatter src={root} {dtype}",
                     lambda i: (dist.scatter(souts[i], chunks, src=dst, group=pair[i]), souts[i])[1],
                     lambda t: [t], dtype, problems)
    return _each_dtype(spec, "gather/scatter", body)


def case_point_to_point(spec):
    def body(pair, me, n, dtype, seed, problems):
        # a ring with both directions posted at once (batch_isend_irecv), then blocking send/recv
        nxt, prv = [dist.get_global_rank(pair[0], (me + k) % n) for k in (1, -1)]
        a = make((4, 3), dtype, seed)
        got = [torch.zeros((4, 3), dtype=dtype) for _ in range(2)]

        def ring(i):
            ops = [dist.P2POp(dist.isend, a, nxt, group=pair[i]),
                   dist.P2POp(dist.irecv, got[i], prv, group=pair[i])]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return got[i]

        run_both(f"batch_isend_irecv ring {dtype}", ring, lambda t: [t], dtype, problems)
        last = dist.get_global_rank(pair[0], n - 1)
        first = dist.get_global_rank(pair[0], 0)
        box = [make((5,), dtype, seed) if me == 0 else torch.zeros(5, dtype=dtype) for _ in range(2)]

        def send_recv(i):
            if me == 0:
                dist.send(box[i], last, group=pair[i])
            elif me == n - 1:
                dist.recv(box[i], first, group=pair[i])
            return box[i]

        run_both(f"send/recv {dtype}", send_recv, lambda t: [t], dtype, problems)
    return _each_dtype(spec, "p2p", body)


def case_objects_and_misc(spec):
    problems: list[str] = []
    if not member(spec):
        return problems
    pair = groups(spec)
    me, n = dist.get_rank(pair[0]), dist.get_world_size(pair[0])
    results = []
    for g in pair:
        objs = [None] * n
        dist.all_gather_object(objs, {"rank": me, "data": list(range(me))}, group=g)
        bl = [f"hello from {me}", me] if me == 0 else [None, None]
        dist.broadcast_object_list(bl, src=dist.get_global_rank(g, 0), group=g)
        sc = [None]
        dist.scatter_object_list(sc, [i * 10 for i in range(n)] if me == 0 else None,
                                 src=dist.get_global_rank(g, 0), group=g)
        ga = [None] * n if me == 0 else None
        dist.gather_object(("x", me), ga, dst=dist.get_global_rank(g, 0), group=g)
        ts = [make((3,), torch.float32, 7 + k) for k in range(3)]
        dist.all_reduce_coalesced(ts, group=g)
        ins = [make((2,), torch.float32, 11 + k) for k in range(2)]
        outs = [torch.zeros(2 * n) for _ in ins]
        with dist._coalescing_manager(group=g):
            for o, t in zip(outs, ins):
                dist.all_gather_single(o, t, group=g)
        dist.barrier(group=g)
        results.append((objs, bl, sc, ga, [t.tolist() for t in ts], [o.tolist() for o in outs]))
    if results[0] != results[1]:
        problems.append(f"objects/coalesced: tpu {results[0]} != gloo {results[1]}")
    return problems
