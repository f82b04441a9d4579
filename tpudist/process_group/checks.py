"""Input checks shared by the collectives, and how XLA's failures are recognised."""

from __future__ import annotations

from typing import Any

import torch

STUCK_GRACE_S = 5.0  # how long timed-out ranks wait for each other's report before naming absentees


def looks_like_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


def looks_like_peer_loss(e: Exception) -> bool:
    text = str(e).lower()
    return "closed by peer" in text or "connection reset" in text or "socket closed" in text



def check_device(op: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: tensor is on device={t.device}; the tpu process group takes cpu tensors and "
                         "'tpu' device tensors (import tpudist.device), all of one call on one device: move it "
                         "with .cpu() or .to('tpu')")
    if t.is_sparse:
        raise TypeError(f"{op}: sparse tensors are not supported; pass t.to_dense()")
    return t


def check_same_dtype(op: str, tensors: list[torch.Tensor]) -> None:
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise TypeError(f"{op}: all tensors must have one dtype, got dtypes={dtypes}")


def check_numel(op: str, what: str, t: torch.Tensor, numel: int) -> None:
    if t.numel() != numel:
        raise ValueError(f"{op}: {what} has {t.numel()} elements (shape {tuple(t.shape)}) but "
                         f"{numel} are needed")


# -- memory overlap ------------------------------------------------------------------------------
# Every tpudist program reads all of its inputs before the first byte of any output is written
# (the inputs are copied or aliased into the XLA call, results are written back after it returns).
# So an output that overlaps an input is well defined: the in-place forms (FSDP2's all_gather into
# a tensor whose chunk is the input, reduce_scatter into a chunk of the input, all_to_all_single of
# a tensor onto itself, ...) all work. What is ill defined is two writes to one byte: outputs that
# overlap each other, an output whose own elements share memory (an expanded view), and a recv
# into memory that another pending send or recv of the same batch uses (their order is tpudist's).
_NO, _YES = 0, 1  # torch._debug_has_internal_overlap: 0 no, 1 yes, 2 too hard to tell
_MAX_RUNS = 1 << 20  # contiguous runs enumerated for the exact test of strided views


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [lo, hi) that ``t`` may touch: from its first element to past its last."""
    if t.is_contiguous():  # the latency path: no per-dim work
        return t.data_ptr(), t.data_ptr() + t.nbytes
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _runs(t: torch.Tensor) -> tuple[Any, Any] | None:
    """Byte intervals (starts, ends) covering ``t``'s elements, or None when there are too many."""
    import numpy as np

    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    run = 1  # elements per contiguous run: merge the innermost dims while they are dense
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    if t.numel() // run > _MAX_RUNS:
        return None
    offsets = np.zeros(1, np.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts = np.sort(t.data_ptr() + offsets * t.element_size())
    return starts, starts + run * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share at least one byte of memory.

    Exact for any strides (interleaved chunks such as ``x.chunk(2, dim=1)`` do not overlap); if a
    view is too fragmented to enumerate (over a million runs) it answers False rather than refuse
    input it cannot judge.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _extent(a), _extent(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    if _dense(a) and _dense(b):
        return True  # each fills its extent
    runs_a, runs_b = _runs(a), _runs(b)
    if runs_a is None or runs_b is None:
        return False
    import numpy as np

    (a_starts, a_ends), (b_starts, b_ends) = runs_a, runs_b
    reach = np.maximum.accumulate(a_ends)  # furthest end among a's runs starting at or before each
    before = np.searchsorted(a_starts, b_ends, side="left") - 1  # a's last run starting before b's end
    hit = before >= 0
    return bool(np.any(reach[before[hit]] > b_starts[hit]))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill its extent exactly (any dim order)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _where(t: torch.Tensor) -> str:
    return (f"shape {tuple(t.shape)}, strides {t.stride()}, byte offset "
            f"{t.storage_offset() * t.element_size()} of its storage")


def check_output(op: str, what: str, t: torch.Tensor) -> None:
    """An output must not have elements that share memory (an expanded or as_strided view)."""
    if t.is_contiguous():
        return
    status = torch._debug_has_internal_overlap(t)
    if status == _YES or (status != _NO and _self_overlaps(t)):
        raise ValueError(
            f"{op}: {what} has elements that share memory ({_where(t)}: an expanded or as_strided "
            "view), so one memory location would receive several results (torch refuses such "
            "outputs too). Pass a tensor that owns its elements, e.g. t.clone(), and copy the "
            "result where it belongs.")


def _self_overlaps(t: torch.Tensor) -> bool:
    runs = _runs(t)
    if runs is None:
        return False
    starts, ends = runs
    return bool(len(starts) > 1 and (starts[1:] < ends[:-1]).any())


def check_outputs(op: str, what: str, tensors: list[torch.Tensor], disjoint: bool = True) -> None:
    """Outputs of one call that receive different data (``disjoint``) may not share memory with one
    another; none may share memory with itself. Named ``what[i]``."""
    for i, t in enumerate(tensors):
        if not t.is_contiguous():  # (contiguous: no shared elements; skip building the name)
            check_output(op, f"{what}[{i}]", t)
    if not disjoint or len(tensors) < 2:
        return
    extents = [_extent(t) for t in tensors]
    active: list[int] = []  # outputs whose extent reaches past the current start
    for i in sorted(range(len(tensors)), key=lambda i: extents[i][0]):
        lo = extents[i][0]
        active = [j for j in active if extents[j][1] > lo]
        for j in active:
            if overlaps(tensors[i], tensors[j]):
                first, second = sorted((i, j))
                raise ValueError(
                    f"{op}: {what}[{first}] and {what}[{second}] share memory ({what}[{first}]: "
                    f"{_where(tensors[first])}; {what}[{second}]: {_where(tensors[second])}). Each "
                    "output receives different data, so what they hold afterwards would depend on "
                    "the order of the writes. Pass tensors that do not overlap, e.g. "
                    "torch.empty_like for each, or the chunks of one tensor.")
        if tensors[i].numel():
            active.append(i)


def check_even_all_to_all(op: str, n: int, input: torch.Tensor, output: torch.Tensor) -> None:
    """all_to_all_single without split sizes: input.shape[0] divides by the group size and the
    output holds as many elements as the input."""
    if input.numel() != output.numel() or (input.dim() and input.shape[0] % n):
        raise ValueError(f"{op}: without split sizes, input.shape[0] must divide by group size={n} "
                         f"and output.numel() must equal input.numel(); got input.shape="
                         f"{tuple(input.shape)}, output.shape={tuple(output.shape)}")


def split_all_to_all(op: str, n: int, input: torch.Tensor, output: torch.Tensor, input_split_sizes: list,
                     output_split_sizes: list) -> tuple[list, list]:
    """all_to_all_single with split sizes: the checked sizes (an empty list: even splits), and the
    input's and output's pieces along dim 0."""
    in_splits = list(input_split_sizes) or [input.shape[0] // n] * n
    out_splits = list(output_split_sizes) or [output.shape[0] // n] * n
    for name, splits, t in (("input", in_splits, input), ("output", out_splits, output)):
        if len(splits) != n or sum(splits) != (t.shape[0] if t.dim() else 1) or min(splits) < 0:
            raise ValueError(f"{op}: {name}_split_sizes={splits} must be {n} non-negative sizes summing "
                             f"to {name}.shape[0]={t.shape[0] if t.dim() else 1}")
    inputs = list(torch.split(input, in_splits)) if input.dim() else [input]
    outputs = list(torch.split(output, out_splits)) if output.dim() else [output]
    return inputs, outputs


def check_all_to_all_lists(op: str, n: int, output_tensors: list, input_tensors: list) -> None:
    if len(output_tensors) != n or len(input_tensors) != n:
        raise ValueError(f"{op}: needs size={n} input and output tensors, got {len(input_tensors)} inputs "
                         f"and {len(output_tensors)} outputs")
