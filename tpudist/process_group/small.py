"""What a synchronous all_reduce small enough for the envelope needs per call, decided once.

A 4-byte all_reduce's XLA program (the envelope exchange) costs ~15 us of main-thread CPU on this
machine; the general path around it (``ProcessGroupTPU._reduce_into``) spent ~70 Python calls and
75-150 us more: a closure and a description per call, the program lookup, the fingerprint built
afresh, the envelope plan interpreted. Issue 15 asks for <= 50 us. ``ProcessGroupTPU.allreduce``
takes a flat path instead where a :class:`SmallAllReduce` exists for the call's (dtype, shape,
reduce op): the same program, the same fingerprint check (ranks that issue different collectives
get ``CollectiveMismatch``) and the same errors, with every view it writes or reads made here.

Per call it writes the fingerprint and the block into every row (one typed view of the rows'
payloads), runs the exchange, and reads the received rows in place: the fingerprints and the data
are each one array made over the program's output with strides decided here, and the reduction is
``envelope.folder``'s, chosen once. (Issue 56: the views of views
and ``fold_into``'s dispatch this replaced cost ~8 us of a 1-rank call's 36 us of Python.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpudist.process_group import envelope, programs
from tpudist.process_group import tensors as tz
from tpudist.process_group.programs import Executable

DATA_OFFSET = envelope.FP_WORDS * 4  # a row's payload, in bytes from its start


@dataclass(frozen=True, slots=True)
class SmallAllReduce:
    """One (group, dtype, shape, reduce op)'s flat all_reduce: its program and the views it uses."""

    description: str  # the Work's, as the general path names it
    group: tuple[int, ...]  # global ranks: the key of the group's call counter
    exchange: Executable  # the group's envelope program
    x_rows: Any  # the global array over ``rows``' memory
    fingerprint: np.ndarray  # this rank's, group code in; the last word is the call number
    fingerprint_slot: np.ndarray  # rows[:, :FP_WORDS]: where every row carries it
    payload: np.ndarray  # rows' data, (n, *shape) in the tensor's numpy dtype: every row carries the block
    view_as: torch.dtype | None  # the tensor's transport view (bfloat16 as int16), as tz.as_numeric
    dtype: np.dtype  # the block's numpy dtype
    numeric: bool  # the tensor's numpy array is already of ``dtype`` (no view needed to fold into it)
    received: tuple[int, ...]  # (n, *shape): the received blocks, one per rank
    received_strides: tuple[int, ...]  # their strides in the received rows' bytes
    fingerprints_shape: tuple[int, int]  # (n, FP_WORDS): every sender's fingerprint ...
    fingerprints_strides: tuple[int, int]  # ... in the received rows' bytes
    fold_into: Any  # envelope.folder's: the received blocks reduced into the tensor
    loop_idle: bool


def build(group: Any, t: torch.Tensor, reduce_op: Any) -> SmallAllReduce | None:
    """The flat all_reduce of ``t``'s (dtype, shape) with ``reduce_op`` on ``group``; None where
    the general path must run: bool (reduced as uint8, written back as bool), PREMUL_SUM (its factor
    is per call), input the general path refuses (it raises the error), data over the envelope's
    payload, or rows XLA would copy rather than read in place."""
    if t.dtype == torch.bool or getattr(reduce_op, "op", reduce_op) == torch.distributed.ReduceOp.PREMUL_SUM:
        return None
    try:
        reduce, static = group.reduce_name("all_reduce", reduce_op, t.dtype)
    except (TypeError, ValueError):
        return None
    block = tz.as_numeric(t)
    key = group.key("all_reduce", block, reduce, static)
    if not envelope.fits(key):
        return None
    compiled = programs.program(key)
    if compiled.fn is not None or compiled.x_rows is None:
        return None
    n, nbytes = len(key.group), block.nbytes
    fingerprint = compiled.call_fingerprint(group.code, 0)
    host = (t.detach() if (view := tz.transport_view(t.dtype)) is None else t.detach().view(view)).numpy()
    # The received rows (the exchange's output, (n, WORDS) int32 per rank, row r from group rank r)
    # are read through arrays made over the output's buffer with these shapes and strides: one
    # numpy call for the fingerprints and one for the data, instead of views of views.
    row = envelope.WORDS * 4
    elem_strides = np.empty(block.shape, block.dtype).strides
    return SmallAllReduce(
        group.describe("all_reduce"), key.group, compiled.envelope_fn, compiled.x_rows,
        fingerprint, envelope.fingerprints(compiled.rows),
        envelope.payload(compiled.rows, nbytes, host.dtype).reshape(n, *block.shape), view,
        block.dtype, host.dtype == block.dtype, (n, *block.shape), (row, *elem_strides),
        (n, envelope.FP_WORDS), (row, 4), envelope.folder(reduce, static, block.dtype), compiled.loop_idle)
