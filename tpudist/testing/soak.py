"""Soak test of the "tpu" backend: long seeded random sequences of collectives checked bit for bit.

A plan is a tuple of :class:`Call` values drawn from a seed; every rank draws the same plan, so a plan
can be printed, compared and unit-tested without processes. Each rank then runs every call twice, on
the "tpu" group and on a gloo group over the same ranks, with identical inputs, and compares both
results bit for bit with a reference computed locally from every rank's known inputs. Inputs are
small integers (integer-valued floats too), so every reduction is exact in any order and the
reference is exact. Where gloo cannot run a call (int16, AVG, PREMUL_SUM, uneven lists, ...) only the
reference decides.

    python -m tpudist soak --ranks 4 --calls 5000 --seed 1

Example (inside a RankPool of 4 "tpu" ranks):
    >>> print(make_plan(seed=1, world_size=4, num_calls=2)[1])
    broadcast[g3] complex64[5] root=0 async #1
    >>> [r.mismatches for r in pool.run(run_plan, 1, 200)]           # doctest: +SKIP
    [(), (), (), ()]
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# Data-moving ops compare raw bytes; reductions also use REDUCE_OPS.
OPS = ("all_reduce", "all_gather", "all_gather_uneven", "all_gather_single", "reduce_scatter_single",
       "all_to_all_single", "all_to_all_single_uneven", "broadcast", "reduce", "gather", "scatter",
       "send_recv", "ring", "barrier")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
          "complex64", "complex128")
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
SHAPES = ((), (0,), (1,), (5,), (2, 3), (0, 3), (257, 131))  # the last: past the 64 KiB envelope for most dtypes
_ASYNC_OPS = frozenset(OPS) - {"send_recv", "ring", "barrier"}
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter_single"})
_NEEDS_DIM = frozenset({"reduce_scatter_single", "all_to_all_single", "all_gather_uneven",
                        "all_to_all_single_uneven"})
_FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
_COMPLEX = frozenset({"complex64", "complex128"})
_TRACE = bool(os.environ.get("TPUDIST_SOAK_TRACE"))  # print each call before it is issued
_PREMUL_FACTOR = 0.5  # a power of two: factor * sum stays exact
# What torch 2.13's gloo refuses (or mishandles) and the reference alone checks.
_GLOO_NO_DTYPES = frozenset({"int16"})
_GLOO_NO_OPS = frozenset({"all_gather_uneven"})
_GLOO_NO_REDUCE = frozenset({"AVG", "PREMUL_SUM"})


def group_specs(world_size: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of the groups a soak uses: the world first, then subgroups created in this order on
    every rank (two with the same members, which share one XLA communicator; one of size 1)."""
    world = tuple(range(world_size))
    specs = [world]
    if world_size >= 2:
        specs += [(0, world_size - 1), (0, world_size - 1), (world_size - 1,)]
    if world_size >= 4:
        specs += [(1, 2, 3), (1, 3)]
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class Call:
    """One collective of a plan.

    ``group`` indexes :func:`group_specs`; ``root`` is a group rank (the sender of ``send_recv``),
    ``peer`` the receiver of ``send_recv`` or the shift of a ``ring``. ``splits[src][dst]`` holds the rows
    rank ``src`` sends ``dst`` (uneven all_to_all), ``splits[0][r]`` the rows of rank ``r`` (uneven
    all_gather). Consecutive ``async_op`` calls are issued together and waited on in order.
    ``index`` is the call's position in the plan and seeds its inputs.
    """

    op: str
    group: int
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    splits: tuple[tuple[int, ...], ...] = ()
    async_op: bool = False
    index: int = 0

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("reduce", self.reduce_op), ("root", self.root),
                                                  ("peer", self.peer), ("splits", self.splits or None))
                        if v is not None)
        return (f"{self.op}[g{self.group}] {self.dtype}{list(self.shape)}{extra}"
                f"{' async' if self.async_op else ''} #{self.index}")


def _reduce_ops_for(dtype: str) -> tuple[str, ...]:
    if dtype in _COMPLEX:
        return ("SUM", "AVG", "PREMUL_SUM")
    if dtype in _FLOATING:
        return ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")
    return ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def make_plan(seed: int, world_size: int, num_calls: int, *, dtypes: tuple[str, ...] = DTYPES,
              shapes: tuple[tuple[int, ...], ...] = SHAPES) -> tuple[Call, ...]:
    """``num_calls`` random calls for ``world_size`` ranks; the same on every rank for a ``seed``.

    Narrow ``dtypes`` / ``shapes`` to repeat programs (each new one compiles, ~0.1-0.4 s).
    """
    if world_size < 1 or num_calls < 0:
        raise ValueError(f"world_size={world_size} must be >= 1 and num_calls={num_calls} >= 0")
    rng = random.Random(seed)
    sizes = [len(s) for s in group_specs(world_size)]
    calls: list[Call] = []
    async_left = 0
    while len(calls) < num_calls:
        group = rng.randrange(len(sizes))
        n = sizes[group]
        ops = [op for op in OPS if n >= 2 or op not in ("send_recv", "ring")]
        op = rng.choice(ops)
        dtype = rng.choice(dtypes)
        shape = rng.choice([s for s in shapes if s] if op in _NEEDS_DIM else shapes)
        kw: dict[str, Any] = {}
        if op in _REDUCING:
            kw["reduce_op"] = rng.choice(_reduce_ops_for(dtype))
        if op in _ROOTED:
            kw["root"] = rng.randrange(n)
        if op == "send_recv":
            kw["root"], kw["peer"] = rng.sample(range(n), 2)
        if op == "ring":
            kw["peer"] = rng.randrange(1, n)
        if op == "all_to_all_single_uneven":
            kw["splits"] = tuple(tuple(rng.randrange(3) for _ in range(n)) for _ in range(n))
        if op == "all_gather_uneven":
            kw["splits"] = (tuple(rng.randrange(3) for _ in range(n)),)
        if op == "barrier":
            dtype, shape = "int32", ()
        if async_left == 0 and op in _ASYNC_OPS and rng.random() < 0.2:
            async_left = rng.randrange(2, 5)
        is_async = async_left > 0 and op in _ASYNC_OPS
        async_left = max(0, async_left - 1) if is_async else 0
        calls.append(Call(op, group, dtype, shape, async_op=is_async, index=len(calls), **kw))
    return tuple(calls)


def gloo_can(call: Call) -> bool:
    """Whether torch's gloo backend runs ``call`` (else the local reference alone checks it)."""
    if call.op == "barrier":
        return True
    if call.dtype in _GLOO_NO_DTYPES or call.op in _GLOO_NO_OPS or call.reduce_op in _GLOO_NO_REDUCE:
        return False
    if call.dtype in _COMPLEX and call.op in ("gather", "reduce", "reduce_scatter_single"):
        return False  # no complex kernels (reduce aborts the process on some ops)
    if call.dtype == "bool" and call.reduce_op in ("BAND", "BOR", "BXOR"):
        return False
    return True


@dataclass(frozen=True, slots=True)
class SoakReport:
    """What one rank saw: calls run, seconds spent in tpu calls and in the whole loop, mismatches."""

    rank: int
    calls: int
    tpu_seconds: float
    total_seconds: float
    gloo_checked: int
    mismatches: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------------------
# Rank side: everything below runs inside rank processes with a "tpu" world group.
_groups: dict[tuple, list] = {}


def _group_pairs(world_size: int) -> list:
    """[(tpu group, gloo group) or None per spec], created once per world, same order on every rank."""
    import torch.distributed as dist

    key = (world_size, id(dist.group.WORLD))
    if key not in _groups:
        _groups.clear()
        pairs = []
        for i, spec in enumerate(group_specs(world_size)):
            tpu = dist.group.WORLD if i == 0 else dist.new_group(list(spec))
            gloo = dist.new_group(list(spec), backend="gloo")
            pairs.append((tpu, gloo) if dist.get_rank() in spec else None)
        _groups[key] = pairs
    return _groups[key]


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _make(call: Call, shape: tuple[int, ...], rank: int, group_size: int, salt: int = 0):
    """Rank ``rank``'s input of ``call``: small integers (integer-valued floats), seeded."""
    import torch

    g = torch.Generator().manual_seed((call.index * 7919 + salt) * 1009 + rank)
    dtype = _dtype(call.dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype == torch.uint8 else -3
    scale = group_size if call.reduce_op == "AVG" else 1  # sum / n stays an integer: exact in any order
    values = torch.randint(low, 4, shape, generator=g) * scale
    if dtype.is_complex:
        imag = torch.randint(-3, 4, shape, generator=g) * scale
        return torch.complex(values.double(), imag.double()).to(dtype)
    t = values.to(dtype)
    if dtype.is_floating_point and call.op not in _REDUCING:
        t[t == 0] = -0.0  # data movement must keep the sign of zero
    return t


def _fold(tensors: list, op: str):
    import torch

    dtype = tensors[0].dtype
    if dtype == torch.bool:
        op = {"SUM": "BOR", "MAX": "BOR", "MIN": "BAND", "PRODUCT": "BAND"}.get(op, op)
    if op in ("BAND", "BOR", "BXOR"):
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = tensors[0].clone()
        for t in tensors[1:]:
            out = fn(out, t)
        return out
    stack = torch.stack([t.to(torch.complex128 if dtype.is_complex else torch.float64)
                         if dtype.is_floating_point or dtype.is_complex else t for t in tensors])
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        out = stack.sum(0)
        out = out / len(tensors) if op == "AVG" else out * _PREMUL_FACTOR if op == "PREMUL_SUM" else out
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(dtype)


class _Exec:
    """Issues one call on one backend and describes the expected result."""

    def __init__(self, call: Call, me: int, spec: tuple[int, ...]):
        self.call, self.me, self.spec, self.n = call, me, spec, len(spec)

    def inputs_of(self, r: int, shape=None, salt: int = 0):
        return _make(self.call, self.call.shape if shape is None else shape, self.spec[r], self.n, salt)

    def issue(self, group) -> tuple[Any, Any]:
        """Starts the call on ``group``; returns (work or None, zero-argument function -> outputs)."""
        import torch
        import torch.distributed as dist

        c, me, n = self.call, self.me, self.n
        dtype = _dtype(c.dtype)
        a = c.async_op
        g_root = dist.get_global_rank(group, c.root) if c.root is not None else None
        rop = _reduce_op(c.reduce_op) if c.reduce_op else None
        if c.op == "all_reduce":
            t = self.inputs_of(me)
            return dist.all_reduce(t, rop, group=group, async_op=a), lambda: [t]
        if c.op == "all_gather":
            outs = [torch.zeros(c.shape, dtype=dtype) for _ in range(n)]
            return dist.all_gather(outs, self.inputs_of(me), group=group, async_op=a), lambda: outs
        if c.op == "all_gather_uneven":
            rows = c.splits[0]
            outs = [torch.zeros((rows[r], *c.shape[1:]), dtype=dtype) for r in range(n)]
            mine = self.inputs_of(me, (rows[me], *c.shape[1:]))
            return dist.all_gather(outs, mine, group=group, async_op=a), lambda: outs
        if c.op == "all_gather_single":
            inp = self.inputs_of(me)
            out = torch.zeros((n * inp.numel(),), dtype=dtype)
            return dist.all_gather_single(out, inp.reshape(-1), group=group, async_op=a), lambda: [out]
        if c.op == "reduce_scatter_single":
            inp = self.inputs_of(me, (n * c.shape[0], *c.shape[1:]))
            out = torch.zeros(c.shape, dtype=dtype)
            return dist.reduce_scatter_single(out, inp, rop, group=group, async_op=a), lambda: [out]
        if c.op == "all_to_all_single":
            inp = self.inputs_of(me, (n * c.shape[0], *c.shape[1:]))
            out = torch.zeros_like(inp)
            return dist.all_to_all_single(out, inp, group=group, async_op=a), lambda: [out]
        if c.op == "all_to_all_single_uneven":
            send = list(c.splits[me])
            recv = [c.splits[r][me] for r in range(n)]
            inp = self.inputs_of(me, (sum(send), *c.shape[1:]))
            out = torch.zeros((sum(recv), *c.shape[1:]), dtype=dtype)
            return dist.all_to_all_single(out, inp, recv, send, group=group, async_op=a), lambda: [out]
        if c.op == "broadcast":
            t = self.inputs_of(me)
            return dist.broadcast(t, g_root, group=group, async_op=a), lambda: [t]
        if c.op == "reduce":
            t = self.inputs_of(me)
            return dist.reduce(t, g_root, rop, group=group, async_op=a), lambda: [t]
        if c.op == "gather":
            outs = [torch.zeros(c.shape, dtype=dtype) for _ in range(n)] if me == c.root else None
            w = dist.gather(self.inputs_of(me), outs, dst=g_root, group=group, async_op=a)
            return w, lambda: outs or []
        if c.op == "scatter":
            chunks = [self.inputs_of(me, salt=1 + j) for j in range(n)] if me == c.root else None
            out = torch.zeros(c.shape, dtype=dtype)
            return dist.scatter(out, chunks, src=g_root, group=group, async_op=a), lambda: [out]
        if c.op == "send_recv":
            t = self.inputs_of(me) if me == c.root else torch.zeros(c.shape, dtype=dtype)
            if me == c.root:
                dist.send(t, dist.get_global_rank(group, c.peer), group=group)
            elif me == c.peer:
                dist.recv(t, g_root, group=group)
            return None, lambda: [t]
        if c.op == "ring":
            t = self.inputs_of(me)
            got = torch.zeros(c.shape, dtype=dtype)
            nxt = dist.get_global_rank(group, (me + c.peer) % n)
            prv = dist.get_global_rank(group, (me - c.peer) % n)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group=group),
                                            dist.P2POp(dist.irecv, got, prv, group=group)])
            for w in works:
                w.wait()
            return None, lambda: [got]
        if c.op == "barrier":
            return dist.barrier(group=group, async_op=False), lambda: []
        raise AssertionError(f"unknown op {c.op}")

    def expected(self) -> list:
        """This rank's outputs, computed from every rank's known inputs."""
        import torch

        c, me, n = self.call, self.me, self.n
        every = range(n)
        if c.op == "all_reduce":
            return [_fold([self.inputs_of(r) for r in every], c.reduce_op)]
        if c.op == "all_gather":
            return [self.inputs_of(r) for r in every]
        if c.op == "all_gather_uneven":
            return [self.inputs_of(r, (c.splits[0][r], *c.shape[1:])) for r in every]
        if c.op == "all_gather_single":
            return [torch.cat([self.inputs_of(r).reshape(-1) for r in every])]
        if c.op == "reduce_scatter_single":
            full = _fold([self.inputs_of(r, (n * c.shape[0], *c.shape[1:])) for r in every], c.reduce_op)
            return [full[me * c.shape[0]:(me + 1) * c.shape[0]]]
        if c.op == "all_to_all_single":
            k = c.shape[0]
            return [torch.cat([self.inputs_of(r, (n * k, *c.shape[1:]))[me * k:(me + 1) * k] for r in every])]
        if c.op == "all_to_all_single_uneven":
            parts = []
            for r in every:
                offset = sum(c.splits[r][:me])
                parts.append(self.inputs_of(r, (sum(c.splits[r]), *c.shape[1:]))[offset:offset + c.splits[r][me]])
            return [torch.cat(parts)]
        if c.op == "broadcast":
            return [self.inputs_of(c.root)]
        if c.op == "reduce":  # a non-dst rank's tensor is left as it was
            return [_fold([self.inputs_of(r) for r in every], c.reduce_op) if me == c.root else self.inputs_of(me)]
        if c.op == "gather":
            return [self.inputs_of(r) for r in every] if me == c.root else []
        if c.op == "scatter":
            return [self.inputs_of(c.root, salt=1 + me)]
        if c.op == "send_recv":
            if me in (c.root, c.peer):
                return [self.inputs_of(c.root)]
            return [torch.zeros(c.shape, dtype=_dtype(c.dtype))]
        if c.op == "ring":
            return [self.inputs_of((me - c.peer) % n)]
        if c.op == "barrier":
            return []
        raise AssertionError(f"unknown op {c.op}")


def _reduce_op(name: str):
    import torch.distributed as dist

    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(_PREMUL_FACTOR)  # noqa: SLF001 - the only public spelling
    return getattr(dist.ReduceOp, name)


def _bits(t):
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return tuple(t.shape), t.dtype, (flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8))


def _canonical(outputs: list) -> list:
    """gloo's SUM of bools adds bytes (True + True stores 2); torch reads any non-zero byte as True."""
    import torch

    return [t.view(torch.uint8).ne(0) if t.dtype == torch.bool else t for t in outputs]


def _diff(got: list, want: list) -> str | None:
    import torch

    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        (sa, da, ba), (sb, db, bb) = _bits(a), _bits(b)
        if sa != sb or da != db or not torch.equal(ba, bb):
            return f"output {i}: {a.tolist()} ({da}{list(sa)}) != {b.tolist()} ({db}{list(sb)})"
    return None


def run_plan(seed: int, num_calls: int, start: int = 0, stop: int | None = None, *,
             compare_gloo: bool = True, dtypes: tuple[str, ...] = DTYPES,
             shapes: tuple[tuple[int, ...], ...] = SHAPES) -> SoakReport:
    """Runs calls ``[start:stop]`` of ``make_plan(seed, world_size, num_calls)`` on this rank.

    Runs in every rank of a "tpu" world (e.g. through ``RankPool.run``). Stops at the first call that
    raises on the tpu backend (the other ranks may then be stuck in it: the caller's timeout ends them).
    """
    import torch.distributed as dist

    world_size, me = dist.get_world_size(), dist.get_rank()
    specs = group_specs(world_size)
    pairs = _group_pairs(world_size)
    plan = make_plan(seed, world_size, num_calls, dtypes=dtypes, shapes=shapes)[start:stop]
    mismatches: list[str] = []
    tpu_s, gloo_checked, began = 0.0, 0, time.perf_counter()
    pending: list[tuple[Call, _Exec, Any, Any]] = []

    def settle(batch):
        nonlocal tpu_s, gloo_checked
        t0 = time.perf_counter()
        for _, _, work, _ in batch:
            if work is not None:
                work.wait()
        tpu_s += time.perf_counter() - t0
        for call, ex, _, outputs in batch:
            problem = _diff(outputs(), ex.expected())
            if problem:
                mismatches.append(f"seed={seed} call {call.index}: {call} on rank {me}: tpu vs reference: {problem}")
            if compare_gloo and gloo_can(call):
                gloo_checked += 1
                work, gloo_out = ex.issue(pairs[call.group][1])
                if work is not None:
                    work.wait()
                problem = _diff(_canonical(gloo_out()), outputs())
                if problem and not (call.op == "reduce" and ex.me != call.root):  # gloo scribbles there
                    mismatches.append(f"seed={seed} call {call.index}: {call} on rank {me}: tpu vs gloo: {problem}")

    for call in plan:
        if not call.async_op and pending:  # batch ends are global, so members settle in one order
            settle(pending)
            pending = []
        pair = pairs[call.group]
        if pair is None:
            continue
        spec = specs[call.group]
        ex = _Exec(call, spec.index(me), spec)
        if _TRACE:
            print(f"rank {me}: {call}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            work, outputs = ex.issue(pair[0])
        except Exception as e:  # noqa: BLE001 - reported with the call that raised, then stop
            mismatches.append(f"seed={seed} call {call.index}: {call} on rank {me}: tpu raised "
                              f"{type(e).__name__}: {e}"[:600])
            break
        tpu_s += time.perf_counter() - t0
        if call.async_op:
            pending.append((call, ex, work, outputs))
        else:
            settle([(call, ex, work, outputs)])
    if pending and not mismatches:
        settle(pending)
    return SoakReport(me, len(plan), tpu_s, time.perf_counter() - began, gloo_checked, tuple(mismatches))


def soak(world_size: int, num_calls: int, seed: int, *, chunk: int = 500, passes: int = 1,
         timeout: float = 600.0, compare_gloo: bool = True, out=print) -> list[str]:
    """Runs a plan on ``world_size`` fresh "tpu" ranks in chunks, printing progress; returns mismatches.

    Later ``passes`` replay the plan with every program compiled: they measure dispatch, not XLA compiles.
    Stops at the first chunk with a mismatch, a crash or a hang (named with the seed and calls).
    """
    from tpudist.testing import RankError, RankPool, RankTimeout

    mismatches: list[str] = []
    with RankPool(world_size, backend="tpu", timeout=timeout) as pool:
        for run in range(passes):
            tpu_s = total_s = 0.0
            for start in range(0, num_calls, chunk):
                stop = min(num_calls, start + chunk)
                try:
                    reports = pool.run(run_plan, seed, num_calls, start, stop, compare_gloo=compare_gloo)
                except (RankError, RankTimeout) as e:  # a hang or a crash is a finding too: name the calls
                    mismatches.append(f"seed={seed} calls {start}..{stop - 1}: {type(e).__name__}: {e}"[:3000])
                    break
                tpu_s += max(r.tpu_seconds for r in reports)
                total_s += max(r.total_seconds for r in reports)
                mismatches += [m for r in reports for m in r.mismatches]
                out(f"pass {run + 1}: calls {stop}/{num_calls}: {stop / tpu_s:,.0f} tpu calls/s (tpu time only), "
                    f"{stop / total_s:,.0f} calls/s with checks, mismatches {len(mismatches)}")
                if mismatches:
                    break
            if mismatches:
                break
    for m in mismatches:
        out(f"MISMATCH {m}")
    return mismatches
