"""all_reduce of a sparse COO tensor, as gloo does it: gather every rank's indices and values,
add the per-rank tensors in rank order and coalesce.

Two programs: an all_gather of a fixed-size header (sparse and dense dims, nnz, dtype, sizes), so
every rank knows every rank's sizes and the ranks that disagree are named on all of them; then one
all_gather of each rank's index and value bytes, padded to the largest. The sum runs on the host
with torch's own sparse ops, in the order gloo's ``AsyncSparseAllreduceWork`` uses, so the result
is the same tensor gloo gives (bit for bit: same additions in the same order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tpudist.process_group import programs
from tpudist.process_group import tensors as tz
from tpudist.process_group.work import Work

MAX_DIMS = 16  # sizes the header carries; a COO tensor of more dims is refused
_HEADER = 4  # sparse_dim, dense_dim, nnz, dtype code
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def check_sparse(op: str, t: torch.Tensor, reduce_name: str) -> torch.Tensor:
    """Refuses what gloo refuses, with the rule and the fix."""
    if t.layout != torch.sparse_coo:
        raise TypeError(f"{op}: layout={t.layout} is not supported; sparse all_reduce takes "
                        "torch.sparse_coo tensors (gloo's rule too): pass t.to_sparse_coo()")
    if reduce_name != programs.SUM:
        raise ValueError(f"{op}: reduce_op={reduce_name.upper()} is not supported for sparse tensors: "
                         "allreduce of sparse tensors only works with ReduceOp.SUM (as on gloo); "
                         "reduce t.to_dense() instead")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{op}: sparse dtype={t.dtype} is not supported; use one of {list(_DTYPES)}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"{op}: a sparse tensor of {t.dim()} dims has more than {MAX_DIMS}")
    if t.requires_grad:
        raise RuntimeError(f"{op}: a sparse tensor that requires grad cannot be reduced in place; "
                           "pass t.detach()")
    return t


def sparse_all_reduce(group: Any, t: torch.Tensor, async_op: bool) -> Work:
    """``group.allreduce([t])`` for a sparse COO ``t`` (SUM): ``t`` becomes the coalesced sum."""
    op = "all_reduce"
    work = Work(group.describe(f"{op} (sparse)"), group.timeout)

    def task():
        local = t.detach().coalesce()
        indices, values = local.indices().contiguous(), local.values().contiguous()
        header = np.full(_HEADER + MAX_DIMS, -1, np.int64)
        header[:_HEADER] = (local.sparse_dim(), local.dense_dim(), indices.shape[1], _DTYPES.index(local.dtype))
        header[_HEADER:_HEADER + local.dim()] = local.shape
        headers = group.run_program(op, group.key("all_gather", header), header)
        _check_headers(group, headers)
        byte_counts = [_nbytes(h) for h in headers]
        width = max(byte_counts)
        pieces = [np.zeros(0, np.uint8)] * len(headers)
        if width:  # every rank sees the same headers, so all skip or all run this program
            mine = np.concatenate([_bytes(indices), _bytes(values)])
            block = tz.padded(mine, width)
            out = group.run_program(op, group.key("all_gather", block), block)
            pieces = [out[r, :byte_counts[r]] for r in range(len(headers))]
        total = None
        for h, piece in zip(headers, pieces):  # gloo's order: rank 0's tensor, then += each next
            part = _unpack(h, piece, local.shape, local.dtype)
            total = part if total is None else total + part
        with torch.no_grad():
            t.copy_(total.coalesce())
        return [t]

    return group.enqueue(work, task, async_op)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def _nbytes(header: np.ndarray) -> int:
    sparse_dim, dense_dim, nnz, code = (int(v) for v in header[:_HEADER])
    sizes = header[_HEADER:_HEADER + sparse_dim + dense_dim]
    dense = int(np.prod(sizes[sparse_dim:])) if dense_dim else 1
    return sparse_dim * nnz * 8 + nnz * dense * torch.empty(0, dtype=_DTYPES[code]).element_size()


def _unpack(header: np.ndarray, raw: np.ndarray, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    sparse_dim, dense_dim, nnz = (int(v) for v in header[:3])
    dense_shape = tuple(shape[sparse_dim:])
    split = sparse_dim * nnz * 8
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    indices = torch.empty((sparse_dim, nnz), dtype=torch.int64)
    values = torch.empty((nnz, *dense_shape), dtype=dtype)
    _bytes(indices)[:] = raw[:split]  # torch views of fresh tensors: writable, contiguous
    _bytes(values)[:] = raw[split:]
    return torch.sparse_coo_tensor(indices, values, shape, dtype=dtype, check_invariants=False)


def _check_headers(group: Any, headers: np.ndarray) -> None:
    """Every rank holds every header, so every rank raises the same error."""

    def describe(h):
        sparse_dim, dense_dim, nnz, code = (int(v) for v in h[:_HEADER])
        sizes = tuple(int(s) for s in h[_HEADER:_HEADER + sparse_dim + dense_dim])
        return (sizes, sparse_dim, _DTYPES[code]), nnz

    layouts = [describe(h)[0] for h in headers]
    if len(set(layouts)) > 1:
        ranks = "; ".join(f"rank {r}: size={list(s)}, sparse_dim={sd}, dtype={dt}"
                          for r, (s, sd, dt) in enumerate(layouts))
        raise ValueError(
            f"{group.describe('all_reduce (sparse)')}: sparse tensors must have the same size, "
            f"sparse_dim and dtype on every rank (only nnz may differ); got {ranks}. No data was "
            "exchanged.")
