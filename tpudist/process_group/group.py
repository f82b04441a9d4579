"""``ProcessGroupTPU``: the "tpu" c10d backend. Each collective runs as XLA programs: the envelope
exchange, then the op's data program where its data does not fit the envelope (programs.py).

torch calls the methods below (their names and argument shapes are c10d's); each validates its
input, builds a :class:`~tpudist.process_group.keys.ProgramKey` and a host block, and submits
the program to the process's comm stream. Results are written back into the caller's tensors.
The methods hold the host path only: ``DEVICE_PATHS`` sends a call whose tensors live on the tpu
device to ``device_collectives`` instead, one check per call for every method.
Synchronous all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and even
all_to_all_single calls on contiguous CPU tensors take flat paths (``_flat_all_reduce``,
``_flat_all_gather``, ``_flat_reduce_scatter``, ``_flat_broadcast``, ``_flat_all_to_all``): the
same programs and errors, run on the caller's thread without the closures and queue.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpudist.process_group import debug, programs, runtime, small
from tpudist.process_group import device_arrays
from tpudist.process_group import device_collectives as dc
from tpudist.process_group import tensors as tz
from tpudist.process_group.channel import REDUCE_NAMES, Channel
from tpudist.process_group.checks import check_device, check_numel, check_output, check_outputs, check_same_dtype
from tpudist.process_group.keys import ProgramKey
from tpudist.process_group.movement import DataMovement
from tpudist.process_group.p2p import P2P
from tpudist.process_group.runtime import GLOO_LOOP
from tpudist.process_group.work import STREAM, Work

BACKEND_NAME = "tpu"
_CONNECT_S = 30  # XLA's key-value timeout for connecting a device set's gloo context

# Method of ProcessGroupTPU (the host path) -> the function of device_collectives that serves its
# calls on tpu tensors, and the c10d options type it takes (None: no options). A c10d method with a
# flat path (CPU tensors only) tries that first and its row names the method it falls back to: the
# flat path, the hot one, pays nothing for the device check.
DEVICE_PATHS: dict[str, tuple[Callable[..., Any], type | None]] = {
    "_all_reduce": (dc.all_reduce, dist.AllreduceOptions),
    "reduce": (dc.reduce, dist.ReduceOptions),
    "allreduce_coalesced": (dc.all_reduce_coalesced, dist.AllreduceCoalescedOptions),
    "reduce_scatter": (dc.reduce_scatter, dist.ReduceScatterOptions),
    "_reduce_scatter_tensors": (dc.reduce_scatter_tensors, dist.ReduceScatterOptions),
    "allgather": (dc.all_gather, c10d.AllgatherOptions),
    "_all_gather_tensors": (dc.all_gather_tensors, c10d.AllgatherOptions),
    "allgather_coalesced": (dc.all_gather_coalesced, c10d.AllgatherOptions),
    "gather": (dc.gather, dist.GatherOptions),
    "_broadcast": (dc.broadcast, dist.BroadcastOptions),
    "scatter": (dc.scatter, dist.ScatterOptions),
    "_all_to_all_single": (dc.all_to_all_single, dist.AllToAllOptions),
    "alltoall": (dc.all_to_all, dist.AllToAllOptions),
    "send": (dc.send, None),
    "recv": (dc.recv, None),
    "recv_anysource": (dc.recv_anysource, None),
}


def _route(host: Callable[..., Any], device: Callable[..., Any], options: type | None) -> Callable[..., Any]:
    """``host`` as torch calls it, except that a call with a tpu tensor among its arguments runs
    ``device`` with the group's channel and the call's arguments in order, its options
    ``options()`` where it gave none (as ``host`` would)."""
    signature = inspect.signature(host)

    @functools.wraps(host)
    def method(self, *args, **kwargs):
        if not dc.on_device(*args, *kwargs.values()):
            return host(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        if options is not None:
            call.arguments["opts"] = call.arguments["opts"] or options()
        return device(self.channel, *call.args[1:])

    return method


def _routed(cls: type) -> type:
    """``cls`` with each method named in ``DEVICE_PATHS`` routed by the device of its call's tensors."""
    for name, (device, options) in DEVICE_PATHS.items():
        setattr(cls, name, _route(getattr(cls, name), device, options))
    return cls


def create_process_group(opts: Any, backend_options: Any) -> "ProcessGroupTPU":
    """The creator torch calls (``extended_api=True``) on every member of a new group."""
    global_ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout, global_ranks)


@_routed
class ProcessGroupTPU(DataMovement, dist.ProcessGroup):
    """A c10d process group whose collectives are XLA collectives over its members' devices."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta,
                 global_ranks: tuple[int, ...]):
        super().__init__(rank, size)
        if len(global_ranks) != size:
            raise ValueError(f"global_ranks={global_ranks} must list size={size} ranks")
        is_world = global_ranks == tuple(range(len(global_ranks))) and not runtime.is_booted()
        self.channel = Channel(store, rank, size, timeout, global_ranks, is_world)
        self._desc = ""
        self._small: dict[tuple, small.SmallAllReduce | bool] = {}  # False: the general path
        if self.channel.is_world:
            runtime.boot(store, global_ranks[rank], size, timeout, owner=self)
            _sync_device()  # the tpu device (if installed) is this rank's chip from now on
        elif not runtime.is_booted():
            raise NotImplementedError(
                f'a "tpu" subgroup (global_ranks={list(global_ranks)}) needs a "tpu" world group: '
                'call init_process_group("tpu") rather than giving "tpu" to new_group only')
        self.channel.detail = debug.for_group(self.channel)  # TPUDIST_DEBUG=DETAIL: store-based checks, else None
        self.channel.inline = self.channel.runs_inline()
        if size > 1:
            # XLA connects a device set's gloo context on its first collective, under a fixed 30 s
            # key-value timeout rather than the group's; connecting now keeps later collectives
            # under the group timeout (and a member that never came fails group creation). A group
            # timing itself from the caller's side (see Channel.enqueue) allows that connection its 30 s.
            self.barrier().wait(max(timeout, timedelta(seconds=_CONNECT_S)))

    # -- identity (torch looks groups up by name: FACTS.md) ---------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self.channel.set_name(name)
        self._small.clear()  # their fingerprints and descriptions hold the name

    def getGroupName(self) -> str:
        return self.channel.name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_name(self) -> str:
        return self.channel.name

    @property
    def _device_types(self) -> list[torch.device]:
        # A Python group has none by default, which breaks object collectives, DCP and
        # set_model_state_dict(broadcast_from_rank0=True) (FACTS.md). Our tensors live on the CPU.
        return [torch.device("cpu")]

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global rank of each group rank."""
        return self.channel.global_ranks

    def __repr__(self) -> str:
        return f"ProcessGroupTPU(rank={self.rank()}, size={self.size()}, ranks={list(self.channel.global_ranks)})"

    # -- plumbing (the rest is the channel's) -----------------------------------------------------
    def _per_rank(self, op: str, lists: list[list[torch.Tensor]], what: str,
                  who: str = "") -> list[torch.Tensor]:
        """The one list of ``size()`` tensors, one per group rank, that list-form ops take (c10d
        passes it wrapped in a list), each checked for its device."""
        if len(lists) != 1 or len(lists[0]) != self.size():
            raise ValueError(f"{op}: {who}needs a list of size={self.size()} {what} tensors, got "
                             f"{[len(x) for x in lists]}")
        return [check_device(op, t) for t in lists[0]]

    @staticmethod
    def _one(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{op}: takes exactly one tensor per rank, got {len(tensors)}; tpudist "
                             "drives one device per process")
        return check_device(op, tensors[0])

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if opts is not None and len(tensors) == 1 and not opts.asyncOp:
            work = self._flat_all_reduce(tensors[0], opts)
            if work is not None:
                return work
        return self._all_reduce(tensors, opts)

    def _all_reduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and tensors[0].is_sparse:
            from tpudist.process_group import sparse

            name = REDUCE_NAMES.get(getattr(opts.reduceOp, "op", opts.reduceOp), str(opts.reduceOp))
            t = sparse.check_sparse("all_reduce", tensors[0], name)
            return sparse.sparse_all_reduce(self.channel, t, opts.asyncOp)
        return self._reduce_into("all_reduce", self._one("all_reduce", tensors), opts.reduceOp,
                                 root=None, async_op=opts.asyncOp)

    def _flat_all_reduce(self, t: Any, opts: Any) -> Work | None:
        """The flat paths of a synchronous all_reduce: the general path's program, fingerprint
        check and errors in a few calls. Data that fits the envelope runs a prepared
        :class:`small.SmallAllReduce`; larger data its data program, the result assembled in the
        tensor. None where neither applies (the general path runs): a tensor it would copy or
        check, bool (written back as bool), a debug or coalescing group, pending sends and recvs,
        queued collectives."""
        if not self._flat_ready(t):
            return None
        if programs.small_enabled():
            key = (t.dtype, t.shape, opts.reduceOp.op)
            entry = self._small.get(key)
            if entry is None:
                entry = self._small[key] = small.build(self.channel, t, opts.reduceOp) or False
            if entry:
                arr = t.detach() if t.requires_grad else t
                arr = (arr if entry.view_as is None else arr.view(entry.view_as)).numpy()
                return STREAM.run_now(Work(entry.description, self.channel.timeout), self._run_small, entry, t, arr)
        if t.dtype == torch.bool:
            return None
        reduce, static = self.channel.reduce_name("all_reduce", opts.reduceOp, t.dtype)
        block = tz.as_numeric(t)
        return self._flat("all_reduce", self.channel.key("all_reduce", block, reduce, static), block, block, t)

    def _run_small(self, entry: small.SmallAllReduce, t: torch.Tensor, arr: np.ndarray) -> list[torch.Tensor]:
        seq = self.channel.programs_run[entry.group] = self.channel.programs_run.get(entry.group, 0) + 1
        fingerprint = entry.fingerprint
        fingerprint[-1] = seq
        entry.fingerprint_slot[...] = fingerprint
        entry.payload[...] = arr  # every row: (n, *shape) <- shape
        GLOO_LOOP.idle(entry.loop_idle)
        try:  # the program's one output, this rank's (n, WORDS) rows; reading it raises what the program raised
            got = entry.exchange.first(entry.x_rows)
        except Exception as e:
            raise self.channel.failure("all_reduce", entry.group, seq, e) from e
        # row r from group rank r; read in place (small.SmallAllReduce)
        fps = np.ndarray(entry.fingerprints_shape, np.int32, got, 0, entry.fingerprints_strides)
        if not programs.all_agree(fps, fingerprint):
            raise self.channel.mismatch("all_reduce", entry.group, fps)
        data = np.ndarray(entry.received, entry.dtype, got, small.DATA_OFFSET, entry.received_strides)
        entry.fold_into(data, arr if entry.numeric else arr.view(entry.dtype))
        return [t]

    def _flat_ready(self, *tensors: Any) -> bool:
        """Whether a synchronous call on ``tensors`` may skip the general path's queue and
        per-call checks: contiguous CPU tensors, a group that runs inline, nothing pending."""
        return (self.channel.inline and self.channel.coalescing is None and P2P.idle()
                and all(isinstance(t, torch.Tensor) and t.is_cpu and t.layout == torch.strided
                        and t.is_contiguous() for t in tensors))

    def _flat(self, op: str, key: ProgramKey, block: np.ndarray, dest: np.ndarray | None,
              output: torch.Tensor) -> Work | None:
        """Runs a flat call of ``op`` now (None, and nothing ran, if a collective is queued)."""
        return STREAM.run_now(Work(self.channel.describe(op), self.channel.timeout), self._run_flat, op, key, block,
                              dest, output)

    def _run_flat(self, op: str, key: ProgramKey, block: np.ndarray, dest: np.ndarray | None,
                  output: torch.Tensor) -> list[torch.Tensor]:
        """A flat call's program (the general path's ``_run_program``), its result in ``dest``
        (None: the result is not kept, as on a broadcast's root)."""
        result = self.channel.run_program(op, key, block, dest)
        if dest is not None and result is not dest:
            np.copyto(dest, result.reshape(dest.shape))
        return [output]

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        root = self.channel.check_rank("reduce", "dst", opts.rootRank)
        return self._reduce_into("reduce", self._one("reduce", tensors), opts.reduceOp, root=root,
                                 async_op=opts.asyncOp)

    def _reduce_into(self, op: str, t: torch.Tensor, reduce_op: Any, root: int | None, async_op: bool):
        check_output(op, "tensor", t)
        reduce, static = self.channel.reduce_name(op, reduce_op, t.dtype)
        block = tz.as_numeric(t)

        def finish(out):
            if out is not dest and (root is None or root == self.rank()):  # dest: t's own memory
                tz.write_numeric(t, out)
            return [t]

        # all_reduce may assemble its result in the tensor itself (no copy back).
        dest = block if root is None and t.is_contiguous() and t.dtype != torch.bool else None
        # reduce's root is in the key (and so in the fingerprint): ranks naming different roots
        # get CollectiveMismatch, not a result on the wrong ranks.
        key = self.channel.key("all_reduce", block, reduce, static, root)
        return self.channel.submit(op, key, block, finish, async_op, dest)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        tensors = [check_device("all_reduce_coalesced", t) for t in tensors]
        check_same_dtype("all_reduce_coalesced", tensors)
        check_outputs("all_reduce_coalesced", "tensors", tensors, disjoint=False)  # same data: may alias
        if not tensors:
            return _done_work(self.channel.describe("all_reduce_coalesced"), self.channel.timeout, [])
        reduce, static = self.channel.reduce_name("all_reduce_coalesced", opts.reduceOp, tensors[0].dtype)
        block = np.concatenate([tz.as_numeric(t).reshape(-1) for t in tensors])
        sizes = [t.numel() for t in tensors]

        def finish(out):
            for t, part in zip(tensors, np.split(out, np.cumsum(sizes)[:-1])):
                tz.write_numeric(t, part)
            return tensors

        key = self.channel.key("all_reduce", block, reduce, static)
        return self.channel.submit("all_reduce_coalesced", key, block, finish, opts.asyncOp)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out = self._one("reduce_scatter", output_tensors)
        chunks = self._per_rank("reduce_scatter", input_tensors, "input")
        check_same_dtype("reduce_scatter", [out, *chunks])
        check_output("reduce_scatter", "output", out)
        check_numel("reduce_scatter", "input_list[rank]", chunks[self.rank()], out.numel())
        width = max(t.numel() for t in chunks)
        block = np.stack([tz.padded(tz.as_numeric(t).reshape(-1), width) for t in chunks])
        return self._reduce_scatter_block("reduce_scatter", block, [out], opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if opts is not None and len(outputs) == 1 == len(inputs) and not opts.asyncOp:
            work = self._flat_reduce_scatter(outputs[0], inputs[0], opts)
            if work is not None:
                return work
        return self._reduce_scatter_tensors(outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_tensors(self, outputs, inputs, opts=None):
        op = "reduce_scatter_tensor"
        opts = opts or dist.ReduceScatterOptions()
        outputs = [check_device(op, t) for t in outputs]
        inputs = [check_device(op, t) for t in inputs]
        check_same_dtype(op, [*outputs, *inputs])
        check_outputs(op, "outputs", outputs)
        for out, inp in zip(outputs, inputs, strict=True):
            check_numel(op, "input", inp, out.numel() * self.size())
        n = self.size()
        blocks = [tz.as_numeric(t).reshape(n, -1) for t in inputs]
        block = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)  # one: no copy
        return self._reduce_scatter_block(op, block, outputs, opts)

    def _flat_reduce_scatter(self, out: Any, inp: Any, opts: Any) -> Work | None:
        """A synchronous reduce_scatter_tensor (FSDP2's gradient reduction) without the general
        path's per-call machinery: the same key, program and errors. None: the general path runs."""
        n = self.size()
        if not (self._flat_ready(out, inp) and out.dtype == inp.dtype and out.dtype != torch.bool
                and inp.numel() == out.numel() * n):
            return None
        op = "reduce_scatter_tensor"
        reduce, static = self.channel.reduce_name(op, opts.reduceOp, out.dtype)
        block = tz.as_numeric(inp).reshape(n, -1)
        key = self.channel.key("reduce_scatter", block, reduce, static)
        return self._flat(op, key, block, tz.as_numeric(out).reshape(-1), out)

    def _reduce_scatter_block(self, op: str, block: np.ndarray, outputs: list[torch.Tensor], opts):
        reduce, static = self.channel.reduce_name(op, opts.reduceOp, outputs[0].dtype)
        sizes = [t.numel() for t in outputs]

        def finish(out):
            for t, part in zip(outputs, np.split(out, np.cumsum(sizes)[:-1])):
                tz.write_numeric(t, part)
            return outputs

        key = self.channel.key("reduce_scatter", block, reduce, static)
        return self.channel.submit(op, key, block, finish, opts.asyncOp)

    # -- point to point: a 2-device ppermute, both sides dispatching the same program -------------
    def send(self, tensors, dst_rank, tag=0):
        t = self._one("send", tensors)
        return self.channel.post("send", t, self.channel.check_rank("send", "dst", dst_rank), tag)

    def recv(self, tensors, src_rank, tag=0):
        t = self._one("recv", tensors)
        return self.channel.post("recv", t, self.channel.check_rank("recv", "src", src_rank), tag)

    def recv_anysource(self, tensors, tag=0):
        # Paired with a sender through the store first, then an ordinary transfer (p2p.py).
        return self.channel.post("recv", self._one("recv", tensors), None, tag)

    # -- synchronisation --------------------------------------------------------------------------
    def barrier(self, opts=None):
        block = np.ones(1, np.int32)
        work = self.channel.submit("barrier", self.channel.key("barrier", block), block, lambda out: [], False)
        return work

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        from tpudist.process_group.monitor import monitored_barrier

        monitored_barrier(self, timeout or self.channel.timeout, wait_all_ranks)

    def _start_coalescing(self, device=None):
        if self.channel.coalescing is not None:
            raise RuntimeError("coalescing already started on this group; end it first")
        self.channel.coalescing = []

    def _end_coalescing(self, device=None):
        works, self.channel.coalescing = self.channel.coalescing or [], None
        work = Work(self.channel.describe("coalesced collectives"), self.channel.timeout)

        def task():  # the stream is FIFO: by now every coalesced collective has run
            for w in works:
                w.wait()
            return [t for w in works for t in (w.get_future().value() or [])]

        return STREAM.submit(work, task, async_op=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        P2P.flush()
        STREAM.drain()
        self._small.clear()  # they hold the runtime's arrays: the runtime is released with the world
        if self.channel.is_world:
            runtime.shutdown(owner=self)
            STREAM.stop()  # no tpudist thread outlives the world
            device_arrays.clear_cache()
            _sync_device()
        if self.channel.detail is not None:
            self.channel.detail.close(self.channel)
        # Release the store: a TCPStore server kept alive here would still accept the clients of
        # the next world's rendezvous on the same port (and so would one held in a reference cycle).
        self.channel.store = None
        if self.channel.is_world:
            gc.collect()

    def abort(self) -> None:
        from tpudist.process_group import lifecycle

        lifecycle.abort(self)  # fails what has not run; does not wait for a collective inside XLA

    def set_timeout(self, timeout: timedelta) -> None:
        self.channel.set_timeout(timeout)



def _sync_device() -> None:
    """Points the tpu device, if ``tpudist.device`` is installed, at the runtime's chip (or at none)."""
    import sys

    if "tpudist.device" in sys.modules:  # installed (importing it here would install it)
        from tpudist.device import interop

        interop.follow_process_group()


def _done_work(description: str, timeout: timedelta, result: Any) -> Work:
    work = Work(description, timeout)
    work.finish(result, None)
    return work
