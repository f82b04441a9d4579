"""The data-moving collectives of :class:`~tpudist.process_group.group.ProcessGroupTPU`.

all_gather (list, tensor and coalesced forms), gather, broadcast, scatter and all_to_all (even,
uneven and list forms) move raw bytes: bit-exact for every dtype, and one program serves every
dtype of a size. A mixin, so the c10d class keeps one method per c10d entry point while each file
holds one kind of collective. The methods are the host path: group.py's ``DEVICE_PATHS`` sends calls
on tpu tensors to ``device_collectives``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import (check_all_to_all_lists, check_device, check_even_all_to_all, check_numel,
                                          check_output, check_outputs, check_same_dtype, split_all_to_all)
from tpudist.process_group.work import Work


class DataMovement:
    """Mixed into ProcessGroupTPU: uses its ``channel`` (keys, ranks, ``submit``), ``rank``, ``size``,
    ``_one``, ``_per_rank``, ``_flat_ready`` and ``_flat``."""

    # -- data movement (raw bytes) ----------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or c10d.AllgatherOptions()
        inp = self._one("all_gather", input_tensors)
        outs = self._per_rank("all_gather", output_tensors, "output")
        check_same_dtype("all_gather", [inp, *outs])
        check_outputs("all_gather", "output_list", outs)
        check_numel("all_gather", f"output_list[{self.rank()}]", outs[self.rank()], inp.numel())
        return self._gather_bytes("all_gather", [inp], [outs], opts.asyncOp)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if opts is not None and len(outputs) == 1 == len(inputs) and not opts.asyncOp:
            work = self._flat_all_gather(outputs[0], inputs[0])
            if work is not None:
                return work
        return self._all_gather_tensors(outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_tensors(self, outputs, inputs, opts=None):
        op = "all_gather_into_tensor"
        opts = opts or c10d.AllgatherOptions()
        outputs = [check_device(op, t) for t in outputs]
        inputs = [check_device(op, t) for t in inputs]
        for out, inp in zip(outputs, inputs, strict=True):
            check_same_dtype(op, [out, inp])
            check_numel(op, "output", out, inp.numel() * self.size())
        check_outputs(op, "outputs", outputs)
        # Non-contiguous outputs receive through a contiguous staging tensor.
        staged = [out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
                  for out in outputs]
        per_rank = [list(s.view(self.size(), s.numel() // self.size())) for s in staged]
        work = self._gather_bytes(op, inputs, per_rank, opts.asyncOp,
                                  into=staged[0] if len(staged) == 1 else None)
        if any(s is not o for s, o in zip(staged, outputs)):
            work.wait()
            with torch.no_grad():
                for s, o in zip(staged, outputs):
                    if s is not o:
                        o.copy_(s)
        return work

    def _flat_all_gather(self, out: Any, inp: Any) -> Work | None:
        """A synchronous all_gather_into_tensor (FSDP2's unshard) without the general path's
        per-call machinery: the key, program and errors of ``_gather_bytes`` for one even input.
        None: the general path runs."""
        n = self.size()
        if not (self._flat_ready(out, inp) and out.dtype == inp.dtype and out.numel() == inp.numel() * n):
            return None
        op = "all_gather_into_tensor"
        unit = tz.byte_unit(tz.nbytes(inp))
        block = tz.raw(inp, unit)
        return self._flat(op, self.channel.key("all_gather", block), block, tz.raw(out, unit).reshape(n, -1), out)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][k]`` receives rank r's input k (torch's docstring: one list per rank,
        each holding a slot for every input)."""
        op = "all_gather_coalesced"
        opts = opts or c10d.AllgatherOptions()
        inputs = [check_device(op, t) for t in input_list]
        lengths = [len(row) for row in output_lists]
        if len(output_lists) != self.size() or any(n != len(inputs) for n in lengths):
            raise ValueError(
                f"{op}: output_tensor_lists must hold size={self.size()} lists (one per rank), each "
                f"with one tensor per input ({len(inputs)} inputs); got {len(output_lists)} lists of "
                f"lengths {lengths}. output_tensor_lists[r][i] receives rank r's input i.")
        per_input = [[check_device(op, output_lists[r][k]) for r in range(self.size())]
                     for k in range(len(inputs))]
        for k, (inp, row) in enumerate(zip(inputs, per_input)):
            check_same_dtype(op, [inp, *row])
            for r, out in enumerate(row):
                check_numel(op, f"output_tensor_lists[{r}][{k}]", out, inp.numel())
        check_outputs(op, "output_tensor_lists (joined)", [t for row in per_input for t in row])
        return self._gather_bytes(op, inputs, per_input, opts.asyncOp)

    def _gather_bytes(self, op: str, inputs: list[torch.Tensor], outputs: list[list[Any]],
                      async_op: bool, root: int | None = None, into: torch.Tensor | None = None):
        """All-gathers the bytes of ``inputs``; ``outputs[k][r]`` receives rank r's input k.

        Uneven sizes (known to every rank from the output shapes) are padded to the largest.
        ``into``: one contiguous tensor whose rows are ``outputs[0]``, which the result can then be
        assembled in directly.
        """
        sizes = [[tz.nbytes_of(o) for o in row] for row in outputs]  # [input k][rank r]
        widths = [max(row) for row in sizes]
        unit = tz.byte_unit(int(np.gcd.reduce([*widths, *(s for row in sizes for s in row), 4])))
        parts = [tz.padded(tz.raw(t, unit), w // unit.itemsize) for t, w in zip(inputs, widths)]
        block = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, unit)
        even = len(inputs) == 1 and all(size == widths[0] for size in sizes[0])
        dest = tz.raw(into, unit).reshape(len(outputs[0]), -1) if into is not None and even else None

        def finish(out):  # out: (n, sum(widths) / unit)
            if root is not None and root != self.rank():
                return None
            raw = out.view(np.uint8)
            offset = 0
            for row, width in zip(outputs, widths):
                for r, o in enumerate(row):
                    tz.write_raw(o, raw[r, offset:offset + tz.nbytes_of(o)])
                offset += width
            return [o for row in outputs for o in row]

        key = self.channel.key("all_gather", block, root=root)  # gather: ranks must agree on the root too
        return self.channel.submit(op, key, block, finish, async_op, dest)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        root = self.channel.check_rank("gather", "dst", opts.rootRank)
        inp = self._one("gather", input_tensors)
        if self.rank() == root:
            outs = self._per_rank("gather", output_tensors, "output", who="dst ")
            check_same_dtype("gather", [inp, *outs])
            check_outputs("gather", "gather_list", outs)
            for t in outs:
                check_numel("gather", "output", t, inp.numel())
        else:
            outs = [tz.Sized(tz.nbytes(inp))] * self.size()
        return self._gather_bytes("gather", [inp], [outs], opts.asyncOp, root=root)

    def broadcast(self, tensors, opts=None):
        if opts is not None and len(tensors) == 1 and not opts.asyncOp:
            work = self._flat_broadcast(tensors[0], opts.rootRank)
            if work is not None:
                return work
        return self._broadcast(tensors, opts)

    def _broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        root = self.channel.check_rank("broadcast", "src", opts.rootRank)
        t = self._one("broadcast", tensors)
        check_output("broadcast", "tensor", t)
        block = tz.as_bytes(t)

        def finish(out):
            if self.rank() != root:
                tz.write_bytes(t, out)
            return [t]

        return self.channel.submit("broadcast", self.channel.key("broadcast", block, static=(root,)), block, finish,
                            opts.asyncOp)

    def _flat_broadcast(self, t: Any, root: int) -> Work | None:
        """A synchronous broadcast of a contiguous CPU tensor without the general path's per-call
        machinery: the same key, program and errors; the root's tensor is left as it is, the
        others receive in place. None: the general path runs."""
        if not self._flat_ready(t):
            return None
        root = self.channel.check_rank("broadcast", "src", root)
        block = tz.as_bytes(t)
        key = self.channel.key("broadcast", block, static=(root,))
        return self._flat("broadcast", key, block, None if self.rank() == root else block, t)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        root = self.channel.check_rank("scatter", "src", opts.rootRank)
        out = self._one("scatter", output_tensors)
        check_output("scatter", "output", out)
        width = tz.nbytes(out)
        unit = tz.byte_unit(width)
        if self.rank() == root:
            chunks = self._per_rank("scatter", input_tensors, "input", who="src ")
            check_same_dtype("scatter", [out, *chunks])
            for t in chunks:
                check_numel("scatter", "input", t, out.numel())
            block = np.stack([tz.raw(t, unit) for t in chunks])
        else:
            block = np.zeros((self.size(), width // unit.itemsize), unit)

        def finish(res):
            tz.write_raw(out, res.view(np.uint8))
            return [out]

        return self.channel.submit("scatter", self.channel.key("scatter", block, static=(root,)), block, finish,
                            opts.asyncOp)

    # -- all_to_all -------------------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if opts is not None and not opts.asyncOp and not output_split_sizes and not input_split_sizes:
            work = self._flat_all_to_all(output, input)
            if work is not None:
                return work
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        op, n = "all_to_all_single", self.size()
        opts = opts or dist.AllToAllOptions()
        output, input = check_device(op, output), check_device(op, input)
        check_same_dtype(op, [output, input])
        check_output(op, "output", output)  # may be the input itself: inputs are read first
        if not output_split_sizes and not input_split_sizes:
            check_even_all_to_all(op, n, input, output)
            unit = tz.byte_unit(tz.nbytes(input) // n)
            block = tz.raw(input, unit).reshape(n, -1)
            dest = tz.raw(output, unit).reshape(n, -1) if output.is_contiguous() else None

            def finish(out):
                tz.write_bytes(output, out)  # nothing to copy when the result was assembled in it
                return [output]

            return self.channel.submit(op, self.channel.key("all_to_all", block), block, finish, opts.asyncOp, dest)
        inputs, outputs = split_all_to_all(op, n, input, output, input_split_sizes, output_split_sizes)
        return self._all_to_all_ragged(op, inputs, outputs, opts.asyncOp, result=[output])

    def _flat_all_to_all(self, output: Any, input: Any) -> Work | None:
        """A synchronous even all_to_all_single of contiguous CPU tensors without the general
        path's per-call machinery: the same key, program and errors, the result assembled in the
        output (which may be the input). None: the general path runs."""
        n = self.size()
        if not (self._flat_ready(output, input) and output.dtype == input.dtype and input.dim()
                and input.shape[0] % n == 0 and output.numel() == input.numel()):
            return None
        unit = tz.byte_unit(tz.nbytes(input) // n)
        block = tz.raw(input, unit).reshape(n, -1)
        return self._flat("all_to_all_single", self.channel.key("all_to_all", block), block,
                          tz.raw(output, unit).reshape(n, -1), output)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        op, n = "all_to_all", self.size()
        opts = opts or dist.AllToAllOptions()
        check_all_to_all_lists(op, n, output_tensors, input_tensors)
        inputs = [check_device(op, t) for t in input_tensors]
        outputs = [check_device(op, t) for t in output_tensors]
        check_same_dtype(op, [*inputs, *outputs])
        check_outputs(op, "output_tensor_list", outputs)
        return self._all_to_all_ragged(op, inputs, outputs, opts.asyncOp, result=outputs)

    def _all_to_all_ragged(self, op: str, inputs, outputs, async_op: bool, result):
        """Sizes differ per pair: agree on the size matrix first, then pad to its largest entry.

        Every rank knows only its own row (what it sends) and column (what it receives), so both are
        all-gathered in a first small program; that also catches split sizes that do not agree.
        """
        n = self.size()
        recv = [tz.nbytes(t) for t in outputs]
        sizes = np.array([tz.nbytes(t) for t in inputs] + recv, np.int64)
        work = Work(self.channel.describe(op), self.channel.timeout)

        def task():
            # Every rank gets every row and column, so every rank reaches the same verdict.
            both = self.channel.run_program(op, self.channel.key("all_gather", sizes), sizes).reshape(n, 2, n)
            matrix, expected = both[:, 0, :], both[:, 1, :].T  # [sender, receiver]
            if not (matrix == expected).all():
                bad = [(int(i), int(j)) for i, j in zip(*np.nonzero(matrix != expected))]
                raise ValueError(
                    f"{op}: split sizes must agree (rank i's output split j == rank j's input split "
                    f"i); in bytes, sender->receiver sends/expects: "
                    + ", ".join(f"{i}->{j}: {matrix[i, j]}/{expected[i, j]}" for i, j in bad))
            width = int(matrix.max())
            unit = tz.byte_unit(int(np.gcd.reduce([*matrix.reshape(-1), width, 4])))
            block = np.stack([tz.padded(tz.raw(t, unit), width // unit.itemsize) for t in inputs])
            out = self.channel.run_program(op, self.channel.key("all_to_all", block), block).view(np.uint8)
            for r, t in enumerate(outputs):
                tz.write_raw(t, out[r, :recv[r]])
            return result

        return self.channel.enqueue(work, task, async_op)
