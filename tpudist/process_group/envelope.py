"""The envelope: a fixed-size block every rank sends to every other rank first, in every program.

Each rank sends every peer one row of ``WORDS`` int32: its call fingerprint (:data:`FP_WORDS` words:
op, reduce op, dtype, size, a hash of the key, group and per-group call number), then up to
:data:`PAYLOAD_BYTES` bytes of data. The rows travel in one XLA ``all_to_all``: a single round of
direct sends, the cheapest fixed-shape exchange measured on XLA:CPU's gloo (see PAYLOAD_BYTES).

Why every program starts with the same fixed-shape exchange:
- ranks compare fingerprints before any data moves, so ranks that issued different collectives
  raise :class:`~tpudist.process_group.work.CollectiveMismatch` instead of exchanging mismatched
  buffers (garbage, or a gloo size check that aborts the process);
- the exchange has the same shape whatever each rank called, so even the check itself cannot be
  a size mismatch;
- a collective whose data fits the payload is finished by that one exchange: the rows a rank
  receives hold everything its result depends on, and :func:`finish` computes it on the host
  (a fold over at most ``n`` rows of at most 4 KiB). One collective instead of two halves the
  latency of small collectives (the 4-byte all_reduce of a loss or a norm).

What a row carries per op (``n`` = group size; ``block`` is one rank's input as the op's lowering
sees it, see :mod:`tpudist.process_group.lowerings`):

    all_reduce, all_gather, broadcast, permute: every row carries the whole block
    reduce_scatter, all_to_all, scatter:        row j carries block[j] (what rank j needs)
    barrier:                                    nothing
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tpudist.process_group.keys import ProgramKey

FP_WORDS = 6
# 4 KiB per row (issue 15). The envelope is the one collective of every small op, so its cost is
# their latency. Bare exchanges (benchmarks/collectives.py --exchanges, 2 and 4 ranks, interleaved):
# an all_to_all of 4 KiB rows costs what one of 32-byte rows costs (2 ranks 0.3 ms, 4 ranks 1.0-1.1 ms
# with the gloo loop idle; loaded machine), while an all_gather of one row or a psum of the same
# bytes (one-hot rows: an all_gather by sum) took 1.7-3x as long on 4 ranks and no less on 2; even a
# 4-byte psum was no faster. 64 KiB rows made a 4-byte all_reduce pay for moving n x 64 KiB and
# ~0.4 ms of numpy. Ops over 4 KiB per row pay a second (data) collective in the same program.
PAYLOAD_BYTES = 4 * 1024
WORDS = FP_WORDS + PAYLOAD_BYTES // 4
_OFFSET = FP_WORDS * 4  # payload start, in bytes

_LOW_PRECISION = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})  # summed in float32
_WHOLE_BLOCK = frozenset({"all_reduce", "all_gather", "broadcast", "permute"})
_ROW_PER_RANK = frozenset({"reduce_scatter", "all_to_all", "scatter"})


def row_bytes(key: ProgramKey) -> int | None:
    """Payload bytes per row for ``key``; None if the op does not travel in the envelope."""
    nbytes = int(np.prod(key.shape, dtype=np.int64)) * np.dtype(key.dtype).itemsize
    if key.op in _WHOLE_BLOCK:
        return nbytes
    if key.op in _ROW_PER_RANK:
        return nbytes // len(key.group)
    return 0 if key.op == "barrier" else None


def fits(key: ProgramKey) -> bool:
    """Whether the whole collective travels in the envelope (one exchange, no second program)."""
    size = row_bytes(key)
    return size is not None and size <= PAYLOAD_BYTES


@dataclass(frozen=True, slots=True)
class Plan:
    """How one key's data travels in the envelope: decided once per program, used every call."""

    key: ProgramKey
    row_bytes: int  # 0 when only the fingerprint travels (barrier, or a full program follows)
    whole_block: bool  # every row carries the whole block (else row j carries block[j])
    dtype: np.dtype
    source: int | None  # permute: the group rank whose row this rank keeps


def plan(key: ProgramKey, me: int, carries_data: bool) -> Plan:
    source = None
    if key.op == "permute":
        source = next((src for src, dst in key.static if dst == me), None)
    size = row_bytes(key) if carries_data else 0
    return Plan(key, size or 0, key.op in _WHOLE_BLOCK, np.dtype(key.dtype), source)


def pack(plan: Plan, block: np.ndarray | None, fingerprint: np.ndarray,
         rows: np.ndarray | None = None) -> np.ndarray:
    """The ``(n, WORDS)`` int32 rows this rank sends: row j goes to group rank j. ``rows``: a
    buffer to write them in, zero-filled when made and shared by the programs of one group. The
    payload past this call's bytes is not cleared (that would cost the memset the buffer saves):
    it holds what an earlier call of the group put in the same row, i.e. sent to the same rank, and
    receivers read only their call's bytes."""
    n = len(plan.key.group)
    rows = np.zeros((n, WORDS), np.int32) if rows is None else rows
    rows[:, :FP_WORDS] = fingerprint
    if plan.row_bytes and block is not None:
        data = np.ascontiguousarray(block).view(np.uint8).reshape(1 if plan.whole_block else n, -1)
        rows.view(np.uint8)[:, _OFFSET:_OFFSET + plan.row_bytes] = data
    return rows


def fingerprints(rows: np.ndarray) -> np.ndarray:
    """Every sender's fingerprint from the rows this rank received: ``(n, FP_WORDS)``."""
    return rows[:, :FP_WORDS]


def payload(rows: np.ndarray, nbytes: int, dtype: np.dtype) -> np.ndarray:
    """The first ``nbytes`` of every row's payload as ``dtype``: ``(n, nbytes // itemsize)``."""
    data = rows.view(np.uint8)[:, _OFFSET:_OFFSET + nbytes]  # rows are strided, bytes dense
    return data.view(dtype) if nbytes % dtype.itemsize == 0 and nbytes else np.ascontiguousarray(data).view(dtype)


def finish(plan: Plan, rows: np.ndarray) -> np.ndarray:
    """This rank's result from the rows it received (row r came from group rank r).

    The same reduction as the op's lowering (:mod:`tpudist.process_group.lowerings`), 16-bit floats
    summed in float32; folds run in rank order here, so float sums may differ from the larger
    ops' direct lowerings (which fold their own chunk first) in the last bit.
    """
    key, n = plan.key, len(plan.key.group)
    if key.op == "barrier":
        return np.zeros(key.shape, plan.dtype)
    data = payload(rows, plan.row_bytes, plan.dtype)
    if key.op in ("all_reduce", "reduce_scatter"):
        part = key.shape if key.op == "all_reduce" else key.shape[1:]
        return fold(data.reshape(n, *part), key.reduce, key.static)
    if key.op in ("all_gather", "all_to_all"):
        return data.reshape(n, *(key.shape if key.op == "all_gather" else key.shape[1:]))
    if key.op == "broadcast":
        return data[key.static[0]].reshape(key.shape)
    if key.op == "scatter":
        return data[key.static[0]].reshape(key.shape[1:])
    if key.op == "permute":
        return np.zeros(key.shape, plan.dtype) if plan.source is None else data[plan.source].reshape(key.shape)
    raise AssertionError(f"op {key.op} does not travel in the envelope")


def fold(rows: np.ndarray, reduce: str, static: tuple = ()) -> np.ndarray:
    """Reduces ``rows`` (one per rank, in rank order) as the lowering of ``reduce`` does."""
    if rows.dtype.kind in "iub":  # integer reductions wrap without warnings
        return _fold(rows, reduce, static)
    with np.errstate(all="ignore"):  # floats overflow to inf silently, as in XLA
        return _fold(rows, reduce, static)


def fold_into(rows: np.ndarray, reduce: str, static: tuple, out: np.ndarray) -> None:
    """:func:`fold` written into ``out`` (of the result's shape and dtype): by the reduction itself
    where it computes in ``out``'s dtype, saving the intermediate and its copy."""
    folder(reduce, static, rows.dtype)(rows, out)


def folder(reduce: str, static: tuple, dtype: np.dtype) -> Callable[[np.ndarray, np.ndarray], None]:
    """:func:`fold_into` for rows of ``dtype``, decided once: a caller that folds the same reduction
    per call (a prepared small all_reduce) keeps it and pays no dispatch per call."""
    ufunc = _UFUNCS.get(reduce)
    if ufunc is None or dtype in _LOW_PRECISION:
        return lambda rows, out: np.copyto(out, fold(rows, reduce, static))
    if dtype.kind in "iub":
        return lambda rows, out: ufunc.reduce(rows, 0, out=out)

    def quietly(rows: np.ndarray, out: np.ndarray) -> None:
        with np.errstate(all="ignore"):  # floats overflow to inf silently, as in XLA
            ufunc.reduce(rows, 0, out=out)

    return quietly


# The reductions that are one ufunc over the rows in their own dtype (sum widens 16-bit floats).
_UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _fold(rows: np.ndarray, reduce: str, static: tuple) -> np.ndarray:
    dtype = rows.dtype
    if reduce in ("sum", "avg", "premul_sum"):
        wide = rows.astype(np.float32) if dtype in _LOW_PRECISION else rows
        if reduce == "premul_sum":
            wide = wide * np.asarray(static[0], dtype=wide.dtype)
        total = np.add.reduce(wide, axis=0, dtype=wide.dtype)
        if reduce == "avg":
            total = total / np.asarray(rows.shape[0], dtype=total.dtype)
        return np.asarray(total).astype(dtype, copy=False)
    return np.asarray(_UFUNCS[reduce].reduce(rows, axis=0, dtype=dtype))
