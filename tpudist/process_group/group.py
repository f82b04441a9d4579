"""``ProcessGroupTPU``: the "tpu" c10d backend. Each collective runs as XLA programs: the envelope
exchange, then the op's data program where its data does not fit the envelope (programs.py).

torch calls the methods below (their names and argument shapes are c10d's); each validates its
input, builds a :class:`~tpudist.process_group.keys.ProgramKey` and a host block, and submits
the program to the process's comm stream. Results are written back into the caller's tensors.
Synchronous all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and even
all_to_all_single calls on contiguous CPU tensors take flat paths (``_flat_all_reduce``,
``_flat_all_gather``, ``_flat_reduce_scatter``, ``_flat_broadcast``, ``_flat_all_to_all``): the
same programs and errors, run on the caller's thread without the closures and queue.
"""

from __future__ import annotations

import functools
import gc
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpudist.process_group import debug, envelope, programs, runtime, small
from tpudist.process_group import device_arrays
from tpudist.process_group import device_collectives as dc
from tpudist.process_group import tensors as tz
from tpudist.process_group.device_arrays import DeviceCall
from tpudist.process_group.checks import (STUCK_GRACE_S, check_device, check_numel, check_output,
                                          check_outputs, check_same_dtype, looks_like_peer_loss,
                                          looks_like_timeout)
from tpudist.process_group.movement import DataMovement
from tpudist.process_group.p2p import P2P
from tpudist.process_group.keys import ProgramKey
from tpudist.process_group.runtime import GLOO_LOOP
from tpudist.process_group.work import (STREAM, CollectiveError, CollectiveMismatch,
                                        CollectiveTimeout, Work)

BACKEND_NAME = "tpu"
_CONNECT_S = 30  # XLA's key-value timeout for connecting a device set's gloo context

_REDUCE_NAMES = {
    dist.ReduceOp.SUM: programs.SUM, dist.ReduceOp.AVG: programs.AVG,
    dist.ReduceOp.PRODUCT: programs.PRODUCT, dist.ReduceOp.MIN: programs.MIN,
    dist.ReduceOp.MAX: programs.MAX, dist.ReduceOp.BAND: programs.BAND,
    dist.ReduceOp.BOR: programs.BOR, dist.ReduceOp.BXOR: programs.BXOR,
    dist.ReduceOp.PREMUL_SUM: programs.PREMUL_SUM,
}
_BITWISE = (programs.BAND, programs.BOR, programs.BXOR)
# bool reduces as uint8 0/1: sum is "or" and product is "and", as gloo does.
_BOOL_REDUCE = {programs.SUM: programs.MAX, programs.PRODUCT: programs.MIN, programs.BAND: programs.MIN,
                programs.BOR: programs.MAX}


def create_process_group(opts: Any, backend_options: Any) -> "ProcessGroupTPU":
    """The creator torch calls (``extended_api=True``) on every member of a new group."""
    global_ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout, global_ranks)


class ProcessGroupTPU(DataMovement, dist.ProcessGroup):
    """A c10d process group whose collectives are XLA collectives over its members' devices."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta,
                 global_ranks: tuple[int, ...]):
        super().__init__(rank, size)
        if len(global_ranks) != size:
            raise ValueError(f"global_ranks={global_ranks} must list size={size} ranks")
        self._store = store
        self._timeout = timeout
        self._global_ranks = global_ranks
        self._is_world = global_ranks == tuple(range(len(global_ranks))) and not runtime.is_booted()
        self._name = ""
        self._group_code = programs.group_code("")
        self._desc = ""
        self._coalescing: list[Work] | None = None
        self._programs_run: dict[tuple[int, ...], int] = {}  # per device set: the call sequence
        self._small: dict[tuple, small.SmallAllReduce | bool] = {}  # False: the general path
        if self._is_world:
            runtime.boot(store, global_ranks[rank], size, timeout, owner=self)
            _sync_device()  # the tpu device (if installed) is this rank's chip from now on
        elif not runtime.is_booted():
            raise NotImplementedError(
                f'a "tpu" subgroup (global_ranks={list(global_ranks)}) needs a "tpu" world group: '
                'call init_process_group("tpu") rather than giving "tpu" to new_group only')
        self._detail = debug.for_group(self)  # TPUDIST_DEBUG=DETAIL: store-based checks, else None
        self._inline = self._runs_inline()
        if size > 1:
            # XLA connects a device set's gloo context on its first collective, under a fixed 30 s
            # key-value timeout rather than the group's; connecting now keeps later collectives
            # under the group timeout (and a member that never came fails group creation). A group
            # timing itself from the caller's side (see _enqueue) allows that connection its 30 s.
            self.barrier().wait(max(timeout, timedelta(seconds=_CONNECT_S)))

    # -- identity (torch looks groups up by name: FACTS.md) ---------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._name = name
        self._group_code = programs.group_code(name)  # in every fingerprint: computed once
        self._small.clear()  # their fingerprints and descriptions hold the name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def _device_types(self) -> list[torch.device]:
        # A Python group has none by default, which breaks object collectives, DCP and
        # set_model_state_dict(broadcast_from_rank0=True) (FACTS.md). Our tensors live on the CPU.
        return [torch.device("cpu")]

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global rank of each group rank."""
        return self._global_ranks

    def __repr__(self) -> str:
        return f"ProcessGroupTPU(rank={self.rank()}, size={self.size()}, ranks={list(self._global_ranks)})"

    # -- plumbing ---------------------------------------------------------------------------------
    def _describe(self, op: str) -> str:
        return f"{op} on group {self._name or '?'} (global ranks {list(self._global_ranks)})"

    def _submit(self, op: str, key: ProgramKey, block: np.ndarray,
                finish: Callable[[np.ndarray], Any], async_op: bool,
                dest: np.ndarray | None = None) -> Work:
        """Queues the program for ``key`` on ``block``; ``finish`` writes its result back. ``dest``:
        the caller's output, contiguous and in the result's shape, which the result may be
        assembled in directly (see :meth:`Compiled.run`)."""
        work = Work(self._describe(op), self._timeout)

        def task():
            return finish(self._run_program(op, key, block, dest))

        return self._enqueue(work, task, async_op)

    def _run_program(self, op: str, key: ProgramKey, block: np.ndarray,
                     dest: np.ndarray | None = None) -> np.ndarray:
        if self._detail is not None:
            self._detail.check(self, op, key)  # raises before any XLA runs
        # A device call (tpu tensors) runs its own program over the same fingerprints (device_arrays.py).
        compiled = programs.program(key) if not isinstance(block, DeviceCall) else device_arrays.program(block)
        seq = self._programs_run[key.group] = self._programs_run.get(key.group, 0) + 1
        fingerprint = compiled.call_fingerprint(self._group_code, seq)
        try:
            result, fingerprints = compiled.run(block, fingerprint, dest)
        except Exception as e:  # XLA raises ValueError/JaxRuntimeError: make it a c10d-style error
            raise self._failure(op, key.group, seq, e) from e
        if result is None:  # run() compared every rank's fingerprint: they differ, nothing moved
            raise self._mismatch(op, key.group, fingerprints)
        return result

    def _failure(self, op: str, device_set: tuple[int, ...], seq: int, e: Exception) -> CollectiveError:
        """The c10d-style error for XLA's ``e`` (ValueError/JaxRuntimeError) at collective ``seq``."""
        for looks_like, error, what in _FAILURES:
            if looks_like(e):
                missing = self._absent_ranks(device_set, seq)
                return error(
                    f"{self._describe(op)}: collective #{seq} over global ranks {list(device_set)} "
                    f"{what.format(missing=missing, timeout=self._timeout.total_seconds())}. Rank "
                    f"{self.rank()} saw: {e}")
        return CollectiveError(f"{self._describe(op)} failed on rank {self.rank()}: {e}")

    def _mismatch(self, op: str, device_set: tuple[int, ...], fingerprints: np.ndarray) -> CollectiveMismatch:
        """Ranks sent different fingerprints: nothing ran. Takes this call back out of the count."""
        self._programs_run[device_set] -= 1  # keep the ranks' counts aligned
        return self._calls_differ(op, range(len(fingerprints)), fingerprints)

    def _calls_differ(self, op: str, ranks: Any, fingerprints: Any) -> CollectiveMismatch:
        """The error each rank raises when the calls of ``ranks`` (their ``fingerprints``, in that
        order) differ, each call in words; p2p.py's pairs raise it too."""
        names = {programs.group_code(g.group_name): g.group_name for g in _live_groups()}
        mixed = len({int(fp[0]) & device_arrays.DEVICE_FLAG for fp in fingerprints}) > 1
        calls = "; ".join(f"rank {r} called {device_arrays.describe_fingerprint(fp, names, mixed)}"
                          for r, fp in zip(ranks, fingerprints))
        return CollectiveMismatch(
            f"{self._describe(op)}: ranks issued different collectives ({calls}). Every rank of "
            "a group must issue the same collectives, with the same shapes, dtypes and reduce "
            "ops, in the same order; no data was exchanged.")

    def _absent_ranks(self, device_set: tuple[int, ...], seq: int) -> list[int]:
        """After a timeout or a lost peer: the global ranks of ``device_set`` that did not also fail at
        collective ``seq``. Every failed rank reports through the store, then waits a grace period."""
        store, me = self._store, self._global_ranks[self.rank()]
        prefix = f"tpudist/stuck/{'-'.join(map(str, device_set))}/{seq}"
        try:
            store.set(f"{prefix}/{me}", b"1")
            deadline = time.monotonic() + STUCK_GRACE_S
            missing = [r for r in device_set if r != me]
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
                time.sleep(0.05)
            return missing
        except Exception:  # noqa: BLE001 - the store itself may be gone: then nobody is known
            return [r for r in device_set if r != me]

    def _key(self, op: str, block: np.ndarray, reduce: str | None = None, static: tuple = (),
             root: int | None = None) -> ProgramKey:
        return ProgramKey(op, block.shape, _dtype_name(block.dtype), self._global_ranks, reduce, static,
                          root)

    def _reduce_name(self, op: str, reduce_op: Any, dtype: torch.dtype) -> tuple[str, tuple]:
        kind = getattr(reduce_op, "op", reduce_op)
        name = _REDUCE_NAMES.get(kind)
        if name is None:
            raise ValueError(f"{op}: reduce_op={reduce_op} is not a c10d ReduceOp")
        static: tuple = ()
        if name == programs.PREMUL_SUM:
            factor = reduce_op.factor
            if isinstance(factor, torch.Tensor):
                factor = factor.item()
            static = (float(factor),)
        if not tz.numeric_supported(dtype):
            raise TypeError(f"{op}: dtype={dtype} cannot be reduced by tpudist; use one of "
                            "float16/bfloat16/float32/float64, int8-int64, uint8, bool, complex")
        floating = dtype in tz.FLOATING or dtype in tz.COMPLEX
        if name in _BITWISE and floating:
            raise TypeError(f"{op}: reduce_op={name.upper()} needs an integer or bool tensor, got "
                            f"dtype={dtype}")
        if name in (programs.AVG, programs.PREMUL_SUM) and not floating:
            raise TypeError(f"{op}: reduce_op={name.upper()} needs a floating or complex tensor, got "
                            f"dtype={dtype}; use SUM and divide")
        if dtype in tz.COMPLEX and name in (programs.MIN, programs.MAX, programs.PRODUCT):
            raise TypeError(f"{op}: reduce_op={name.upper()} is not defined for complex dtype={dtype}")
        if dtype == torch.bool:
            name = _BOOL_REDUCE.get(name, name)
        return name, static

    def _check_rank(self, op: str, what: str, rank: int) -> int:
        if not 0 <= rank < self.size():
            raise ValueError(f"{op}: {what}={rank} is not a rank of this group of size {self.size()}; "
                             f"group ranks are 0..{self.size() - 1}")
        return rank

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
        opts = opts or dist.AllreduceOptions()
        if dc.on_device(tensors):
            return dc.all_reduce(self, tensors, opts)
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and tensors[0].is_sparse:
            from tpudist.process_group import sparse

            name = _REDUCE_NAMES.get(getattr(opts.reduceOp, "op", opts.reduceOp), str(opts.reduceOp))
            t = sparse.check_sparse("all_reduce", tensors[0], name)
            return sparse.sparse_all_reduce(self, t, opts.asyncOp)
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
                entry = self._small[key] = small.build(self, t, opts.reduceOp) or False
            if entry:
                arr = t.detach() if t.requires_grad else t
                arr = (arr if entry.view_as is None else arr.view(entry.view_as)).numpy()
                return STREAM.run_now(Work(entry.description, self._timeout), self._run_small, entry, t, arr)
        if t.dtype == torch.bool:
            return None
        reduce, static = self._reduce_name("all_reduce", opts.reduceOp, t.dtype)
        block = tz.as_numeric(t)
        return self._flat("all_reduce", self._key("all_reduce", block, reduce, static), block, block, t)

    def _run_small(self, entry: small.SmallAllReduce, t: torch.Tensor, arr: np.ndarray) -> list[torch.Tensor]:
        seq = self._programs_run[entry.group] = self._programs_run.get(entry.group, 0) + 1
        fingerprint = entry.fingerprint
        fingerprint[-1] = seq
        entry.fingerprint_slot[...] = fingerprint
        entry.payload[...] = arr.reshape(-1).view(np.uint8)
        GLOO_LOOP.idle(entry.loop_idle)
        try:
            got = entry.exchange(entry.x_rows)[0]
        except Exception as e:  # as _run_program
            raise self._failure("all_reduce", entry.group, seq, e) from e
        if not programs.all_agree(envelope.fingerprints(got), fingerprint):
            raise self._mismatch("all_reduce", entry.group, envelope.fingerprints(got))
        data = envelope.payload(got, entry.nbytes, entry.dtype).reshape(entry.received)
        envelope.fold_into(data, entry.reduce, entry.static, arr.view(entry.dtype))
        return [t]

    def _flat_ready(self, *tensors: Any) -> bool:
        """Whether a synchronous call on ``tensors`` may skip the general path's queue and
        per-call checks: contiguous CPU tensors, a group that runs inline, nothing pending."""
        return (self._inline and self._coalescing is None and P2P.idle()
                and all(isinstance(t, torch.Tensor) and t.is_cpu and t.layout == torch.strided
                        and t.is_contiguous() for t in tensors))

    def _flat(self, op: str, key: ProgramKey, block: np.ndarray, dest: np.ndarray | None,
              output: torch.Tensor) -> Work | None:
        """Runs a flat call of ``op`` now (None, and nothing ran, if a collective is queued)."""
        return STREAM.run_now(Work(self._describe(op), self._timeout), self._run_flat, op, key, block,
                              dest, output)

    def _run_flat(self, op: str, key: ProgramKey, block: np.ndarray, dest: np.ndarray | None,
                  output: torch.Tensor) -> list[torch.Tensor]:
        """A flat call's program (the general path's ``_run_program``), its result in ``dest``
        (None: the result is not kept, as on a broadcast's root)."""
        result = self._run_program(op, key, block, dest)
        if dest is not None and result is not dest:
            np.copyto(dest, result.reshape(dest.shape))
        return [output]

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        if dc.on_device(tensors):
            return dc.reduce(self, tensors, opts)
        root = self._check_rank("reduce", "dst", opts.rootRank)
        return self._reduce_into("reduce", self._one("reduce", tensors), opts.reduceOp, root=root,
                                 async_op=opts.asyncOp)

    def _reduce_into(self, op: str, t: torch.Tensor, reduce_op: Any, root: int | None, async_op: bool):
        check_output(op, "tensor", t)
        reduce, static = self._reduce_name(op, reduce_op, t.dtype)
        block = tz.as_numeric(t)

        def finish(out):
            if out is not dest and (root is None or root == self.rank()):  # dest: t's own memory
                tz.write_numeric(t, out)
            return [t]

        # all_reduce may assemble its result in the tensor itself (no copy back).
        dest = block if root is None and t.is_contiguous() and t.dtype != torch.bool else None
        # reduce's root is in the key (and so in the fingerprint): ranks naming different roots
        # get CollectiveMismatch, not a result on the wrong ranks.
        key = self._key("all_reduce", block, reduce, static, root)
        return self._submit(op, key, block, finish, async_op, dest)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        if dc.on_device(tensors):
            return dc.all_reduce_coalesced(self, tensors, opts)
        tensors = [check_device("all_reduce_coalesced", t) for t in tensors]
        check_same_dtype("all_reduce_coalesced", tensors)
        check_outputs("all_reduce_coalesced", "tensors", tensors, disjoint=False)  # same data: may alias
        if not tensors:
            return _done_work(self._describe("all_reduce_coalesced"), self._timeout, [])
        reduce, static = self._reduce_name("all_reduce_coalesced", opts.reduceOp, tensors[0].dtype)
        block = np.concatenate([tz.as_numeric(t).reshape(-1) for t in tensors])
        sizes = [t.numel() for t in tensors]

        def finish(out):
            for t, part in zip(tensors, np.split(out, np.cumsum(sizes)[:-1])):
                tz.write_numeric(t, part)
            return tensors

        key = self._key("all_reduce", block, reduce, static)
        return self._submit("all_reduce_coalesced", key, block, finish, opts.asyncOp)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if dc.on_device(output_tensors, input_tensors):
            return dc.reduce_scatter(self, output_tensors, input_tensors, opts)
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
        op = "reduce_scatter_tensor"
        if opts is not None and len(outputs) == 1 == len(inputs) and not opts.asyncOp:
            work = self._flat_reduce_scatter(outputs[0], inputs[0], opts)
            if work is not None:
                return work
        opts = opts or dist.ReduceScatterOptions()
        if dc.on_device(outputs, inputs):
            return dc.reduce_scatter_tensors(self, outputs, inputs, opts)
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

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _flat_reduce_scatter(self, out: Any, inp: Any, opts: Any) -> Work | None:
        """A synchronous reduce_scatter_tensor (FSDP2's gradient reduction) without the general
        path's per-call machinery: the same key, program and errors. None: the general path runs."""
        n = self.size()
        if not (self._flat_ready(out, inp) and out.dtype == inp.dtype and out.dtype != torch.bool
                and inp.numel() == out.numel() * n):
            return None
        op = "reduce_scatter_tensor"
        reduce, static = self._reduce_name(op, opts.reduceOp, out.dtype)
        block = tz.as_numeric(inp).reshape(n, -1)
        key = self._key("reduce_scatter", block, reduce, static)
        return self._flat(op, key, block, tz.as_numeric(out).reshape(-1), out)

    def _reduce_scatter_block(self, op: str, block: np.ndarray, outputs: list[torch.Tensor], opts):
        reduce, static = self._reduce_name(op, opts.reduceOp, outputs[0].dtype)
        sizes = [t.numel() for t in outputs]

        def finish(out):
            for t, part in zip(outputs, np.split(out, np.cumsum(sizes)[:-1])):
                tz.write_numeric(t, part)
            return outputs

        key = self._key("reduce_scatter", block, reduce, static)
        return self._submit(op, key, block, finish, opts.asyncOp)

    # -- point to point: a 2-device ppermute, both sides dispatching the same program -------------
    def send(self, tensors, dst_rank, tag=0):
        t = self._p2p_one("send", tensors)
        return P2P.post(self, "send", t, self._check_rank("send", "dst", dst_rank), tag)

    def recv(self, tensors, src_rank, tag=0):
        t = self._p2p_one("recv", tensors)
        return P2P.post(self, "recv", t, self._check_rank("recv", "src", src_rank), tag)

    def recv_anysource(self, tensors, tag=0):
        # Paired with a sender through the store first, then an ordinary transfer (p2p.py).
        return P2P.post(self, "recv", self._p2p_one("recv", tensors), None, tag)

    def _p2p_one(self, op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The one tensor of a send or recv; p2p.py moves a tpu tensor's storage with no host copy."""
        return dc.one_on_device(op, tensors) if dc.on_device(tensors) else self._one(op, tensors)

    # -- synchronisation --------------------------------------------------------------------------
    def barrier(self, opts=None):
        block = np.ones(1, np.int32)
        work = self._submit("barrier", self._key("barrier", block), block, lambda out: [], False)
        return work

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        from tpudist.process_group.monitor import monitored_barrier

        monitored_barrier(self, timeout or self._timeout, wait_all_ranks)

    def _start_coalescing(self, device=None):
        if self._coalescing is not None:
            raise RuntimeError("coalescing already started on this group; end it first")
        self._coalescing = []

    def _end_coalescing(self, device=None):
        works, self._coalescing = self._coalescing or [], None
        work = Work(self._describe("coalesced collectives"), self._timeout)

        def task():  # the stream is FIFO: by now every coalesced collective has run
            for w in works:
                w.wait()
            return [t for w in works for t in (w.get_future().value() or [])]

        return STREAM.submit(work, task, async_op=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def _enqueue(self, work: Work, task: Callable[[], Any], async_op: bool) -> Work:
        P2P.flush()  # pending sends/recvs were issued first: keep the order on every rank
        if self._coalescing is not None:
            self._coalescing.append(work)
            async_op = True
        if self._timeout.total_seconds() < runtime.current().collective_timeout_s:
            # XLA's collective timeout is per process (the first world's); a group with a shorter
            # one runs on the comm thread and whoever waits gets CollectiveTimeout at the group's
            # timeout. XLA cannot cancel the call: it ends at XLA's timeout (lifecycle.py).
            async_op = True
        return STREAM.submit(work, task, async_op=async_op)

    def shutdown(self) -> None:
        P2P.flush()
        STREAM.drain()
        self._small.clear()  # they hold the runtime's arrays: the runtime is released with the world
        if self._is_world:
            runtime.shutdown(owner=self)
            STREAM.stop()  # no tpudist thread outlives the world
            device_arrays.clear_cache()
            _sync_device()
        if self._detail is not None:
            self._detail.close(self)
        # Release the store: a TCPStore server kept alive here would still accept the clients of
        # the next world's rendezvous on the same port (and so would one held in a reference cycle).
        self._store = None
        if self._is_world:
            gc.collect()

    def abort(self) -> None:
        from tpudist.process_group import lifecycle

        lifecycle.abort(self)  # fails what has not run; does not wait for a collective inside XLA

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._inline = self._runs_inline()

    def _runs_inline(self) -> bool:
        """Whether a synchronous collective may run in the caller's thread (else see _enqueue), with
        no per-call checks besides the program's own (TPUDIST_DEBUG=DETAIL adds store checks)."""
        return self._detail is None and self._timeout.total_seconds() >= runtime.current().collective_timeout_s


# How XLA's failures read, what tpudist raises for them, and how the message puts it.
_FAILURES = (
    (looks_like_timeout, CollectiveTimeout, "did not complete within the timeout of {timeout:g}s: ranks "
                                            "{missing} never reached it (a rank that is hung elsewhere, "
                                            "took another branch, or died)"),
    (looks_like_peer_loss, CollectiveError, "lost its peers; ranks {missing} did not report (they died or hang)"),
)


def _sync_device() -> None:
    """Points the tpu device, if ``tpudist.device`` is installed, at the runtime's chip (or at none)."""
    import sys

    if "tpudist.device" in sys.modules:  # installed (importing it here would install it)
        from tpudist.device import interop

        interop.follow_process_group()


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # numpy computes the name on every access (~5 us on the latency path)


def _live_groups() -> list[Any]:
    return [g for g in c10d._world.pg_map if isinstance(g, ProcessGroupTPU)]  # noqa: SLF001


def _done_work(description: str, timeout: timedelta, result: Any) -> Work:
    work = Work(description, timeout)
    work._finish(result, None)  # noqa: SLF001
    return work
