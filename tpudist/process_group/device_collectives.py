"""The c10d entry points of :class:`~tpudist.process_group.group.ProcessGroupTPU` for "tpu" tensors.

group.py's ``DEVICE_PATHS`` hands a c10d method's call here when a tensor argument lives on the
tpu device (:func:`on_device`), the one place that choice is made. A function checks the call as the
CPU path does, describes it as a :class:`~tpudist.process_group.device_arrays.Plan` (which views
are read, how they make the block, where the result goes) and submits it through the group's
channel (``submit``/``run_program``, ``post`` for a send or recv), so ordering, fingerprints,
timeouts and errors are the CPU path's. Blocks hold elements of the
tensors' dtype (the CPU path moves raw bytes for data-moving ops; XLA's data movement keeps every
bit either way).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tpudist.process_group import device_arrays as da
from tpudist.process_group.checks import (check_all_to_all_lists, check_even_all_to_all, check_numel, check_output,
                                          check_same_dtype, split_all_to_all)
from tpudist.process_group.keys import DTYPE_NAMES, ProgramKey
from tpudist.process_group.work import Work

_NUMERIC = {torch.bool: "uint8", torch.bfloat16: "bfloat16"}  # else: the numpy name of the dtype


def on_device(*args: Any) -> bool:
    """Whether any tensor in ``args`` (tensors, or lists of them, nested) is a tpu tensor."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cpu and a.device.type == "tpu":
                return True
        elif isinstance(a, (list, tuple)) and on_device(*a):
            return True
    return False


def _tensors(args: Any) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


def check_all_on_device(op: str, **named: Any) -> None:
    """Every tensor of a call must be a tpu tensor once one is: else a ValueError naming where."""
    where = {name: sorted({str(t.device) for t in _tensors([v])}) for name, v in named.items()}
    if any(d != "tpu" and not d.startswith("tpu:") for ds in where.values() for d in ds):
        listed = ", ".join(f"{name} on {'/'.join(ds)}" for name, ds in where.items() if ds)
        raise ValueError(f"{op}: mixes cpu and tpu tensors ({listed}); all tensors of one collective must "
                         "live on one device: move them with .to('tpu') or .cpu()")


def numeric_dtype(op: str, dtype: torch.dtype) -> str:
    """The numpy name of the dtype a block of ``dtype`` elements has (bool as uint8); TypeError where none."""
    name = _NUMERIC.get(dtype)
    if name is None:
        try:
            name = np.dtype(str(dtype).removeprefix("torch.")).name
        except TypeError:
            name = ""
        if name not in DTYPE_NAMES:
            raise TypeError(f"{op}: dtype={dtype} is not supported for tpu tensors in collectives; use "
                            "float16/bfloat16/float32/float64, int8-int64, uint8, bool or complex")
    return name


def _key(pg: Any, op: str, shape: tuple, dtype: str, reduce: str | None = None, static: tuple = (),
         root: int | None = None) -> ProgramKey:
    return ProgramKey(op, tuple(int(s) for s in shape), dtype, pg.global_ranks, reduce, static, root)


def _submit(pg: Any, op: str, key: ProgramKey, inputs: list, widths: list, layout: str,
            outputs: list, result: list, async_op: bool) -> Work:
    for i, (t, _) in enumerate(outputs):
        check_output(op, f"output {i}", t)  # an expanded view: one element, several results
    call = da.prepare(key, pg.rank, inputs, widths, layout, outputs)

    def finish(new_values):
        da.write_back(call, new_values)
        return result

    return pg.submit(op, key, call, finish, async_op)


def _one(op: str, tensors: list) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{op}: takes exactly one tensor per rank, got {len(tensors)}; tpudist drives "
                         "one device per process")
    check_all_on_device(op, tensor=tensors)
    return tensors[0]


def _per_rank(pg: Any, op: str, lists: list, what: str, who: str = "") -> list:
    if len(lists) != 1 or len(lists[0]) != pg.size:
        raise ValueError(f"{op}: {who}needs a list of size={pg.size} {what} tensors, got "
                         f"{[len(x) for x in lists]}")
    return list(lists[0])


def _flat(start: int, numel: int) -> tuple[str, int, int]:
    return ("flat", start, start + numel)


# -- reductions --------------------------------------------------------------------------------------


def all_reduce(pg: Any, tensors: list, opts: Any) -> Work:
    t = _one("all_reduce", tensors)
    return _reduce_into(pg, "all_reduce", t, opts.reduceOp, None, opts.asyncOp)


def reduce(pg: Any, tensors: list, opts: Any) -> Work:
    root = pg.check_rank("reduce", "dst", opts.rootRank)
    return _reduce_into(pg, "reduce", _one("reduce", tensors), opts.reduceOp, root, opts.asyncOp)


def _reduce_into(pg: Any, op: str, t: torch.Tensor, reduce_op: Any, root: int | None, async_op: bool):
    reduce, static = pg.reduce_name(op, reduce_op, t.dtype)
    key = _key(pg, "all_reduce", t.shape or (1,), numeric_dtype(op, t.dtype), reduce, static, root)
    outputs = [(t, _flat(0, t.numel()))] if root is None or root == pg.rank else []
    return _submit(pg, op, key, [t], [t.numel()], "flat", outputs, [t], async_op)


def all_reduce_coalesced(pg: Any, tensors: list, opts: Any) -> Work:
    op = "all_reduce_coalesced"
    check_all_on_device(op, tensors=tensors)
    check_same_dtype(op, tensors)
    reduce, static = pg.reduce_name(op, opts.reduceOp, tensors[0].dtype)
    sizes = [t.numel() for t in tensors]
    starts = np.cumsum([0, *sizes])
    key = _key(pg, "all_reduce", (int(starts[-1]),), numeric_dtype(op, tensors[0].dtype), reduce, static)
    outputs = [(t, _flat(int(s), t.numel())) for t, s in zip(tensors, starts)]
    return _submit(pg, op, key, tensors, sizes, "flat", outputs, tensors, opts.asyncOp)


def reduce_scatter(pg: Any, output_tensors: list, input_tensors: list, opts: Any) -> Work:
    op = "reduce_scatter"
    check_all_on_device(op, output=output_tensors, input_list=input_tensors)
    out = _one(op, output_tensors)
    chunks = _per_rank(pg, op, input_tensors, "input")
    check_same_dtype(op, [out, *chunks])
    check_numel(op, "input_list[rank]", chunks[pg.rank], out.numel())
    width = max(t.numel() for t in chunks)
    reduce, static = pg.reduce_name(op, opts.reduceOp, out.dtype)
    key = _key(pg, "reduce_scatter", (pg.size, width), numeric_dtype(op, out.dtype), reduce, static)
    return _submit(pg, op, key, chunks, [width] * len(chunks), "flat", [(out, _flat(0, out.numel()))],
                   [out], opts.asyncOp)


def reduce_scatter_tensors(pg: Any, outputs: list, inputs: list, opts: Any) -> Work:
    op = "reduce_scatter_tensor"
    check_all_on_device(op, outputs=outputs, inputs=inputs)
    check_same_dtype(op, [*outputs, *inputs])
    n = pg.size
    for out, inp in zip(outputs, inputs, strict=True):
        check_numel(op, "input", inp, out.numel() * n)
    reduce, static = pg.reduce_name(op, opts.reduceOp, outputs[0].dtype)
    sizes = [t.numel() for t in outputs]
    starts = np.cumsum([0, *sizes])
    key = _key(pg, "reduce_scatter", (n, int(starts[-1])), numeric_dtype(op, outputs[0].dtype), reduce, static)
    outs = [(t, _flat(int(s), t.numel())) for t, s in zip(outputs, starts)]
    return _submit(pg, op, key, inputs, [t.numel() for t in inputs], "cols", outs, outputs, opts.asyncOp)


# -- data movement ----------------------------------------------------------------------------------


def all_gather(pg: Any, output_tensors: list, input_tensors: list, opts: Any) -> Work:
    op = "all_gather"
    check_all_on_device(op, output_tensor_list=output_tensors, input=input_tensors)
    inp = _one(op, input_tensors)
    outs = _per_rank(pg, op, output_tensors, "output")
    check_same_dtype(op, [inp, *outs])
    check_numel(op, f"output_list[{pg.rank}]", outs[pg.rank], inp.numel())
    return _gather(pg, op, [inp], [outs], opts.asyncOp)


def all_gather_tensors(pg: Any, outputs: list, inputs: list, opts: Any) -> Work:
    """all_gather_into_tensor (and its coalesced form): output k holds every rank's input k in
    rank order."""
    op = "all_gather_into_tensor"
    check_all_on_device(op, outputs=outputs, inputs=inputs)
    n = pg.size
    for out, inp in zip(outputs, inputs, strict=True):
        check_same_dtype(op, [out, inp])
        check_numel(op, "output", out, inp.numel() * n)
    check_same_dtype(op, [*outputs, *inputs])
    widths = [t.numel() for t in inputs]
    starts = np.cumsum([0, *widths])
    key = _key(pg, "all_gather", (int(starts[-1]),), numeric_dtype(op, inputs[0].dtype))
    outs = [(t, ("cols", int(s), int(s) + w)) for t, s, w in zip(outputs, starts, widths)]
    return _submit(pg, op, key, inputs, widths, "flat", outs, outputs, opts.asyncOp)


def all_gather_coalesced(pg: Any, output_lists: list, input_list: list, opts: Any) -> Work:
    op = "all_gather_coalesced"
    check_all_on_device(op, output_tensor_lists=output_lists, input_tensor_list=input_list)
    n, inputs = pg.size, list(input_list)
    lengths = [len(row) for row in output_lists]
    if len(output_lists) != n or any(k != len(inputs) for k in lengths):
        raise ValueError(
            f"{op}: output_tensor_lists must hold size={n} lists (one per rank), each with one tensor "
            f"per input ({len(inputs)} inputs); got {len(output_lists)} lists of lengths {lengths}. "
            "output_tensor_lists[r][i] receives rank r's input i.")
    per_input = [[output_lists[r][k] for r in range(n)] for k in range(len(inputs))]
    for k, (inp, row) in enumerate(zip(inputs, per_input)):
        check_same_dtype(op, [inp, *row])
        for r, out in enumerate(row):
            check_numel(op, f"output_tensor_lists[{r}][{k}]", out, inp.numel())
    return _gather(pg, op, inputs, per_input, opts.asyncOp)


def gather(pg: Any, output_tensors: list, input_tensors: list, opts: Any) -> Work:
    op = "gather"
    root = pg.check_rank(op, "dst", opts.rootRank)
    check_all_on_device(op, gather_list=output_tensors, tensor=input_tensors)
    inp = _one(op, input_tensors)
    if pg.rank == root:
        outs = _per_rank(pg, op, output_tensors, "output", who="dst ")
        check_same_dtype(op, [inp, *outs])
        for t in outs:
            check_numel(op, "output", t, inp.numel())
    else:
        outs = [None] * pg.size
    return _gather(pg, op, [inp], [outs], opts.asyncOp, root=root)


def _gather(pg: Any, op: str, inputs: list, outputs: list, async_op: bool, root: int | None = None):
    """All-gathers ``inputs``; ``outputs[k][r]`` (a tensor, or None on a rank that keeps nothing)
    receives rank r's input k. Uneven sizes (every rank knows them from the output shapes) are
    padded to the largest."""
    widths = [max([t.numel() for t in row if t is not None] or [inp.numel()])
              for inp, row in zip(inputs, outputs)]
    starts = np.cumsum([0, *widths])
    total = int(starts[-1])
    key = _key(pg, "all_gather", (total,), numeric_dtype(op, inputs[0].dtype), root=root)
    keep = root is None or root == pg.rank
    outs = [(t, _flat(r * total + int(s), t.numel())) for row, s in zip(outputs, starts)
            for r, t in enumerate(row) if keep and t is not None]
    result = [t for row in outputs for t in row if t is not None]
    return _submit(pg, op, key, inputs, widths, "flat", outs, result, async_op)


def broadcast(pg: Any, tensors: list, opts: Any) -> Work:
    op = "broadcast"
    root = pg.check_rank(op, "src", opts.rootRank)
    t = _one(op, tensors)
    key = _key(pg, "broadcast", t.shape or (1,), numeric_dtype(op, t.dtype), static=(root,))
    outputs = [(t, _flat(0, t.numel()))] if pg.rank != root else []
    return _submit(pg, op, key, [t], [t.numel()], "flat", outputs, [t], opts.asyncOp)


def scatter(pg: Any, output_tensors: list, input_tensors: list, opts: Any) -> Work:
    op = "scatter"
    root = pg.check_rank(op, "src", opts.rootRank)
    check_all_on_device(op, tensor=output_tensors, scatter_list=input_tensors)
    out = _one(op, output_tensors)
    width = out.numel()
    chunks = []
    if pg.rank == root:
        chunks = _per_rank(pg, op, input_tensors, "input", who="src ")
        check_same_dtype(op, [out, *chunks])
        for t in chunks:
            check_numel(op, "input", t, width)
    key = _key(pg, "scatter", (pg.size, width), numeric_dtype(op, out.dtype), static=(root,))
    return _submit(pg, op, key, chunks, [width] * len(chunks), "flat", [(out, _flat(0, width))], [out],
                   opts.asyncOp)


def all_to_all_single(pg: Any, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list,
                      input_split_sizes: list, opts: Any) -> Work:
    op, n = "all_to_all_single", pg.size
    check_all_on_device(op, output=[output], input=[input])
    check_same_dtype(op, [output, input])
    if not output_split_sizes and not input_split_sizes:
        check_even_all_to_all(op, n, input, output)
        key = _key(pg, "all_to_all", (n, input.numel() // n), numeric_dtype(op, input.dtype))
        return _submit(pg, op, key, [input], [input.numel()], "flat", [(output, _flat(0, output.numel()))],
                       [output], opts.asyncOp)
    inputs, outputs = split_all_to_all(op, n, input, output, input_split_sizes, output_split_sizes)
    return _all_to_all_ragged(pg, op, inputs, outputs, opts.asyncOp, [output])


def all_to_all(pg: Any, output_tensors: list, input_tensors: list, opts: Any) -> Work:
    op, n = "all_to_all", pg.size
    check_all_to_all_lists(op, n, output_tensors, input_tensors)
    check_all_on_device(op, output_tensor_list=output_tensors, input_tensor_list=input_tensors)
    check_same_dtype(op, [*input_tensors, *output_tensors])
    return _all_to_all_ragged(pg, op, list(input_tensors), list(output_tensors), opts.asyncOp,
                              list(output_tensors))


def _all_to_all_ragged(pg: Any, op: str, inputs: list, outputs: list, async_op: bool, result: list):
    """Sizes differ per pair: the ranks agree on the size matrix first (a small host program over
    the sizes, which are metadata), then every piece is padded on the device to the largest."""
    n = pg.size
    dtype = numeric_dtype(op, inputs[0].dtype)
    sizes = np.array([t.numel() for t in inputs] + [t.numel() for t in outputs], np.int64)
    work = Work(pg.describe(op), pg.timeout)

    def task():
        both = pg.run_program(op, pg.key("all_gather", sizes), sizes).reshape(n, 2, n)
        matrix, expected = both[:, 0, :], both[:, 1, :].T  # [sender, receiver], in elements
        if not (matrix == expected).all():
            bad = [(int(i), int(j)) for i, j in zip(*np.nonzero(matrix != expected))]
            raise ValueError(
                f"{op}: split sizes must agree (rank i's output split j == rank j's input split i); in "
                "elements, sender->receiver sends/expects: "
                + ", ".join(f"{i}->{j}: {matrix[i, j]}/{expected[i, j]}" for i, j in bad))
        width = max(1, int(matrix.max()))
        key = _key(pg, "all_to_all", (n, width), dtype)
        outs = [(t, _flat(r * width, t.numel())) for r, t in enumerate(outputs)]
        call = da.prepare(key, pg.rank, inputs, [width] * n, "flat", outs)
        da.write_back(call, pg.run_program(op, key, call))
        return result

    return pg.enqueue(work, task, async_op)


# -- point to point: posted, paired and run as 2-device programs by p2p.py, with no host copy -----------


def send(pg: Any, tensors: list, dst_rank: int, tag: int = 0) -> Work:
    t = _one("send", tensors)
    return pg.post("send", t, pg.check_rank("send", "dst", dst_rank), tag)


def recv(pg: Any, tensors: list, src_rank: int, tag: int = 0) -> Work:
    t = _one("recv", tensors)
    return pg.post("recv", t, pg.check_rank("recv", "src", src_rank), tag)


def recv_anysource(pg: Any, tensors: list, tag: int = 0) -> Work:
    return pg.post("recv", _one("recv", tensors), None, tag)
