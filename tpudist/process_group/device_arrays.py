"""Collective programs over "tpu" device tensors: their ``jax.Array`` s go in, results stay on the device.

A CPU tensor's collective runs on numpy blocks (:mod:`~tpudist.process_group.tensors`); a device
tensor's storage already holds a flat ``jax.Array`` on this rank's chip (``tpudist.device``). A
:class:`Plan` says, as static data, how the call's tensors sit on their storages, how their values
make the op's block, and which part of the result lands in which output. Three jitted programs
then do all of it on the device:

    read        storages (flat jax.Arrays) -> the input views' values -> the block -> the pieces
    collective  fingerprint exchange; the op's lowering body over the group's mesh (the same
                ``LOWERINGS`` body as the CPU path: the same bits)
    write       the result into the output views -> the written storages' new values

Storages, pieces and results move between the programs as device buffers (``batched_device_put``
of an array itself makes the global array over its own buffer) and the last program's outputs
become the storages' values. Nothing of the tensors' data goes through the host; the only
device-to-host read is the ranks' fingerprints (6 int32 per rank) that decide whether to write.

The fingerprint check is the CPU path's: every rank first exchanges ``(n, envelope.WORDS)`` rows
(built on the device here, fingerprint words only), and the data moves under a ``lax.cond`` only
if every rank agrees. Device calls carry :data:`DEVICE_FLAG` in their fingerprint, so a rank passing
tpu tensors and a rank passing cpu tensors to the same collective get ``CollectiveMismatch``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpudist.process_group import envelope, programs
from tpudist.process_group.lowerings import LOWERINGS
from tpudist.process_group.keys import ProgramKey

DEVICE_FLAG = 1 << 30  # in fingerprint word 0 (root_code * 256 + op index: far below 2**30)


@dataclass(frozen=True, slots=True)
class View:
    """Where a tensor sits: its storage's slot in the call, and its geometry over that storage."""

    slot: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dtype: Any  # torch dtype of the tensor
    pairs: bool = False  # a real view of a complex storage (see complex_pairs): geometry in complex elements


def _view(slot: int, t: Any, storage_dtype: Any) -> View:
    """``t``'s geometry over its storage. c10d hands complex tensors to backends as
    ``torch.view_as_real`` views (send, recv, all_reduce...): a real view of a complex storage, whose
    elements the device cannot reinterpret (different item sizes). Such a view is described in the
    storage's complex elements, and read and written as (..., 2) real pairs."""
    sizes, strides, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    if storage_dtype.is_complex and t.dtype != storage_dtype and t.dtype == storage_dtype.to_real():
        if not (sizes and sizes[-1] == 2 and strides[-1] == 1 and offset % 2 == 0
                and all(s % 2 == 0 for s in strides[:-1])):
            raise NotImplementedError(
                f"a {t.dtype} view of shape={sizes}, strides={strides}, offset={offset} over a "
                f"{storage_dtype} storage: only torch.view_as_real's layout (last dim 2, stride 1) is "
                "supported for tpu tensors in collectives; pass the complex tensor or a copy")
        return View(slot, sizes[:-1], tuple(s // 2 for s in strides[:-1]), offset // 2, storage_dtype, True)
    return View(slot, sizes, strides, offset, t.dtype)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the device program of one call depends on (the program cache's key).

    ``inputs`` are read, cast to ``key.dtype`` (bool -> uint8, as the CPU path reduces it),
    flattened and zero-padded to ``widths``; ``layout`` "flat" concatenates them into
    ``key.shape``, "cols" concatenates their ``(n, -1)`` reshapes along dim 1 (reduce_scatter of
    several tensors). ``outputs[i] = (view, (kind, start, stop))`` takes ``result.reshape(-1)[start:stop]``
    ("flat") or ``result[:, start:stop]`` ("cols") of the op's result into ``view``.
    """

    key: ProgramKey
    me: int  # this rank's index in the group
    slots: tuple[tuple[int, Any, bool], ...]  # (numel, storage torch dtype, unwritten) per storage
    inputs: tuple[View, ...]
    widths: tuple[int, ...]
    layout: str
    outputs: tuple[tuple[View, tuple[str, int, int]], ...]


class DeviceCall:
    """One call: its plan, the storages' values when the call was issued, and the storages."""

    __slots__ = ("plan", "arrays", "buffers")

    def __init__(self, plan: Plan, arrays: tuple, buffers: tuple):
        self.plan, self.arrays, self.buffers = plan, arrays, buffers

    @property
    def written_slots(self) -> list[int]:
        return sorted({view.slot for view, _ in self.plan.outputs})


def prepare(key: ProgramKey, me: int, inputs: list, widths: list[int], layout: str,
            outputs: list[tuple[Any, tuple[str, int, int]]]) -> DeviceCall:
    """The call's plan and the storages' current values (a pending fused graph runs first).

    Called on the caller's thread when the collective is issued: the values are immutable
    ``jax.Array`` s, so what the collective sends is what the tensors held at the call."""
    from tpudist.device import interop

    with interop.LOCK:
        buffers: list = []
        slot_of: dict[int, int] = {}

        def view_of(t) -> View:
            buf = interop.buffer_of(t)
            slot = slot_of.get(id(buf))
            if slot is None:
                slot = slot_of[id(buf)] = len(buffers)
                buffers.append(buf)
            return _view(slot, t, buf.dtype)

        in_views = tuple(view_of(t) for t in inputs)
        out_specs = tuple((view_of(t), index) for t, index in outputs)
        arrays = tuple(interop.concrete(b) for b in buffers)
    slots = tuple((b.numel, b.dtype, a is None) for b, a in zip(buffers, arrays))
    plan = Plan(key, me, slots, in_views, tuple(widths), layout, out_specs)
    return DeviceCall(plan, tuple(a for a in arrays if a is not None), tuple(buffers))


def write_back(call: DeviceCall, new_values: list) -> None:
    """The program's new storage values become the storages' values (no copy: the same arrays)."""
    from tpudist.device import interop

    with interop.LOCK:
        for slot, value in zip(call.written_slots, new_values):
            call.buffers[slot].value = value


# -- programs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compiled:
    """A built device call: the interface :meth:`~tpudist.process_group.channel.Channel.run_program` uses for both paths.

    Three programs: ``read`` (this rank's views -> the lowering's input pieces), ``collective``
    (the fingerprint exchange and the lowering's body over the group's mesh) and ``write`` (the
    result into this rank's output views). Only ``collective`` spans the ranks, and it is the same
    program on every rank: what differs per rank (tensor geometry, this rank's place in the group)
    stays in the local programs. XLA may order independent collectives differently in programs that
    differ, and a rank sending peer 2's piece while that peer waits for peer 1's deadlocks (seen
    with 4 ranks when the reads and writes were inside the collective program).
    """

    key: ProgramKey
    read: Any  # (storages) -> (block, pieces): one jitted program on this rank's device
    collective: Any  # (fp, *pieces) -> (outs, fingerprints), jitted over the group's mesh
    write: Any  # (storages, block, outs) -> the written storages' new values
    piece_avals: tuple  # global avals of the collective's piece inputs
    fingerprint_host: np.ndarray
    sharding: Any
    device: Any
    fp_aval: Any

    def call_fingerprint(self, group_code: int, seq: int) -> np.ndarray:
        return np.concatenate([self.fingerprint_host, np.array([group_code, seq], np.int32)])

    def run(self, call: DeviceCall, fingerprint: np.ndarray,
            dest: Any = None) -> tuple[list | None, np.ndarray]:
        """Runs the call; returns (the written storages' new values, every rank's fingerprint),
        the values None when the fingerprints disagree (then no data moved)."""
        import jax

        with jax.enable_x64(True):  # the device keeps int64/float64 (FACTS.md: JAX truncates otherwise)
            block, pieces = execute("read", self.read, call.arrays)
            fp = _put(self.fp_aval, self.sharding, fingerprint, self.device)
            inputs = [_put(aval, self.sharding, piece, self.device)
                      for aval, piece in zip(self.piece_avals, pieces)]
            outs, fps = execute("collective", self.collective, fp, *inputs)
            fps = _read_fingerprints(fps)
            if not (fps == fps[0]).all():
                return None, fps
            new = execute("write", self.write, call.arrays, block, [o.addressable_data(0) for o in outs])
        return list(new), fps


def run_agreed(call: DeviceCall) -> list:
    """Runs a call whose ranks already agreed on it (point to point: :class:`p2p.PairOrder`
    compares the two sides' fingerprints before either runs), so the collective goes alone: no
    fingerprint exchange, no device-to-host read. Returns the written storages' new values.

    A tensor that is its whole storage (contiguous, offset 0, the storage's dtype, which the op
    moves as it is) needs neither the read nor the write program: its storage's array is the
    collective's input, and the collective's output becomes its storage's value. A receiver with
    no input hands in its own storage's array (its value is ignored: the permute only sends from
    the sender), or zeros when the storage was never written. One program instead of three: the
    latency of a small send is mostly per-program dispatch (benchmarks/p2p.py).
    """
    import jax

    plan = call.plan
    direct = _direct_slot(call)
    compiled = program(call, verify=False)
    with jax.enable_x64(True):
        if direct is None:
            block, pieces = execute("read", compiled.read, call.arrays)
        else:
            pieces = (_own_array(call, direct),)
        inputs = [_put(aval, compiled.sharding, piece, compiled.device)
                  for aval, piece in zip(compiled.piece_avals, pieces)]
        if direct is not None:
            outs = execute("permute", _permute(compiled), *inputs)
            local = [o.addressable_data(0) for o in outs]
            jax.block_until_ready(local)  # done (or failed) when the call returns, as the checked path
            return local if plan.outputs else []
        fp = _put(compiled.fp_aval, compiled.sharding, compiled.call_fingerprint(0, 0), compiled.device)
        outs, _ = execute("collective", compiled.collective, fp, *inputs)
        new = execute("write", compiled.write, call.arrays, block, [o.addressable_data(0) for o in outs])
        jax.block_until_ready(new)
    return list(new)


def _direct_slot(call: DeviceCall) -> int | None:
    """The storage slot of a call that moves one whole storage as it is (see :func:`run_agreed`),
    else None."""
    plan = call.plan
    views = [*plan.inputs, *(view for view, _ in plan.outputs)]
    if len(views) != 1 or len(plan.slots) != 1:
        return None
    (view,) = views
    numel, storage_dtype, _ = plan.slots[view.slot]
    whole = (view.offset == 0 and not view.pairs and view.dtype == storage_dtype
             and math.prod(view.sizes) == numel == math.prod(plan.key.shape)
             and view.strides == _contiguous_strides(view.sizes))
    if not whole or np.dtype(plan.key.dtype) != np.dtype(_jax_dtype(storage_dtype)):
        return None
    if plan.outputs and plan.outputs[0][1] != ("flat", 0, numel):
        return None
    if call.arrays and (call.arrays[0].shape != (numel,) or call.arrays[0].dtype != np.dtype(plan.key.dtype)):
        return None
    return view.slot


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _own_array(call: DeviceCall, slot: int) -> Any:
    """The direct call's input: the storage's array (a receiver's is ignored), or zeros if unwritten."""
    import jax.numpy as jnp

    numel, dtype, unwritten = call.plan.slots[slot]
    if unwritten:
        return jnp.zeros((numel,), _jax_dtype(dtype))
    return call.arrays[0]


_permutes: dict[ProgramKey, Any] = {}


def _permute(compiled: Compiled) -> Any:
    """The collective's body alone over the group's mesh (no fingerprint input or output)."""
    fn = _permutes.get(compiled.key)
    if fn is None:
        import jax
        from jax.sharding import PartitionSpec as P

        from tpudist.process_group.lowerings import AXIS

        lowering = LOWERINGS[compiled.key.op](compiled.key, 0)
        mesh = compiled.sharding.mesh
        jitted = jax.jit(jax.shard_map(lambda *pieces: tuple(lowering.body(*pieces)), mesh=mesh,
                                       in_specs=(P(AXIS),) * len(compiled.piece_avals), out_specs=P(AXIS),
                                       check_vma=False))
        fn = _permutes[compiled.key] = programs.CachedProgram(
            jitted, list(mesh.devices.flat), ("device_permute", compiled.key, compiled.piece_avals, _device_digest()))
    return fn


def _put(aval: Any, sharding: Any, local: Any, device: Any) -> Any:
    """The global array whose shard on this rank is ``local`` (a jax.Array: its own buffer, no copy;
    or a small numpy array)."""
    from jax._src.lib import xla_client

    return xla_client.batched_device_put(aval, sharding, [local], [device], True)


def execute(stage: str, fn: Any, *args: Any) -> Any:
    """Runs one of a call's programs (one place, so tests can watch what goes in and comes out)."""
    return fn(*args)


def _read_fingerprints(fps: Any) -> np.ndarray:
    """The one device-to-host read of a device collective: ``(n, FP_WORDS)`` int32 fingerprints."""
    import jax

    return np.asarray(jax.device_get(fps.addressable_data(0)))


_cache: dict[tuple[Plan, bool], Compiled] = {}
_lock = threading.Lock()
stats = {"hits": 0, "misses": 0}


def program(call: DeviceCall, verify: bool | None = None) -> Compiled:
    """The compiled program for ``call``'s plan, built on first use. ``verify``: whether the
    collective exchanges fingerprints first (default: the process-wide switch)."""
    from tpudist.process_group import runtime

    if verify is None:
        verify = programs.VERIFY.on  # the switch every rank flips together
    entry = (call.plan, verify)
    compiled = _cache.get(entry)
    if compiled is not None:
        if compiled.device is runtime.current().local_device:
            stats["hits"] += 1
            return compiled
        clear_cache()  # built in an earlier world (its runtime was torn down by an abort)
    with _lock:
        compiled = _cache.get(entry)
        if compiled is None:
            compiled = _cache[entry] = _build(*entry)
            stats["misses"] += 1
    return compiled


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _permutes.clear()


def fingerprint(key: ProgramKey) -> np.ndarray:
    fp = programs.fingerprint(key)
    fp[0] |= DEVICE_FLAG
    return fp


def describe_fingerprint(fp: np.ndarray, group_names: dict[int, str] | None, mixed: bool) -> str:
    """:func:`programs.describe_fingerprint`, naming the tensors' device where ranks mixed them."""
    on_device = bool(int(fp[0]) & DEVICE_FLAG)
    plain = fp.copy()
    plain[0] = int(fp[0]) & ~DEVICE_FLAG
    text = programs.describe_fingerprint(plain, group_names)
    return f"{text} on {'tpu' if on_device else 'cpu'} tensors" if mixed else text


def _build(plan: Plan, verify: bool) -> Compiled:
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpudist.process_group import runtime
    from tpudist.process_group.lowerings import AXIS

    key = plan.key
    n = len(key.group)
    mesh = programs.mesh_of(key.group)
    lowering = LOWERINGS[key.op](key, plan.me)
    written = sorted({view.slot for view, _ in plan.outputs})
    initialised = [i for i, (_, _, unwritten) in enumerate(plan.slots) if not unwritten]

    def read(arrays):
        flats = _storages(plan, dict(zip(initialised, arrays)))
        block = _block(plan, [_read(flats[v.slot], v, key.dtype) for v in plan.inputs])
        return block, tuple(lowering.split(block))

    def spmd(fp, *pieces):
        if not verify:
            return tuple(lowering.body(*pieces)), jnp.broadcast_to(fp, (n, envelope.FP_WORDS))
        rows = jnp.zeros((n, envelope.WORDS), jnp.int32).at[:, :envelope.FP_WORDS].set(fp)
        fps = envelope.fingerprints(programs.exchange(rows))  # the CPU path's exchange
        agree = jnp.all(fps == fps[0:1])
        shapes = jax.eval_shape(lowering.body, *pieces)
        outs = jax.lax.cond(agree, lambda ps: tuple(lowering.body(*ps)),
                            lambda ps: tuple(jnp.zeros(s.shape, s.dtype) for s in shapes), pieces)
        return tuple(outs), fps

    def write(arrays, block, outs):
        flats = _storages(plan, dict(zip(initialised, arrays)))
        result = _join(key, plan.me, lowering, block, list(outs))
        for view, index in plan.outputs:
            flats[view.slot] = _write(flats[view.slot], view, _take(result, index))
        return tuple(flats[s] for s in written)

    with jax.enable_x64(True):
        stand_ins = [jax.ShapeDtypeStruct((numel,), _jax_dtype(dtype))
                     for i, (numel, dtype, _) in enumerate(plan.slots) if i in initialised]
        _, piece_shapes = jax.eval_shape(read, stand_ins)
    piece_avals = tuple(core.ShapedArray((n * p.shape[0], *p.shape[1:]), p.dtype) for p in piece_shapes)
    collective = jax.jit(jax.shard_map(spmd, mesh=mesh, in_specs=(P(AXIS),) * (1 + len(piece_avals)),
                                       out_specs=P(AXIS), check_vma=False))
    sharding = NamedSharding(mesh, P(AXIS))
    fp_aval = core.ShapedArray((n * envelope.FP_WORDS,), np.int32)
    # XLA executables from tpudist's program cache (else compiled at the first call): the local
    # programs keyed by the plan and this rank's device, the collective (the same on every rank: see
    # Compiled) by what decides it and the group's devices, all by the device's and lowerings' sources.
    device, digest, cached = runtime.current().local_device, _device_digest(), programs.CachedProgram
    return Compiled(key, cached(jax.jit(read), [device], ("device_read", plan, digest)),
                    cached(collective, list(mesh.devices.flat),
                           ("device_collective", key, verify, piece_avals, digest)),
                    cached(jax.jit(write), [device], ("device_write", plan, digest)),
                    piece_avals, fingerprint(key), sharding, device, fp_aval)


def _device_digest() -> str:
    from tpudist.device import interop

    return interop.source_digest()


def _jax_dtype(dtype: Any) -> Any:
    import tpudist.ops as tops

    return tops.to_jax_dtype(dtype)


# -- inside the program ------------------------------------------------------------------------------


def _storages(plan: Plan, given: dict[int, Any]) -> list:
    import jax.numpy as jnp

    import tpudist.ops as tops

    return [given[i] if i in given else jnp.zeros((numel,), tops.to_jax_dtype(dtype))  # unwritten: zeros
            for i, (numel, dtype, _) in enumerate(plan.slots)]


def _read(flat: Any, view: View, numeric: str) -> Any:
    """A view's values, flat, in the dtype the op computes with."""
    import jax.numpy as jnp

    import tpudist.ops as tops
    from tpudist.device import interop, views

    value = interop.retype(views.read(flat, view.sizes, view.strides, view.offset), tops.to_jax_dtype(view.dtype))
    if view.pairs:
        value = jnp.stack([value.real, value.imag], axis=-1)
    return value.reshape(-1).astype(np.dtype(numeric))


def _block(plan: Plan, parts: list) -> Any:
    import jax.numpy as jnp

    key = plan.key
    dtype = np.dtype(key.dtype)
    if not parts:
        return jnp.zeros(key.shape, dtype)
    if plan.layout == "cols":
        n = len(key.group)
        return jnp.concatenate([p.reshape(n, -1) for p in parts], axis=1)
    padded = [jnp.pad(p, (0, w - p.shape[0])) if w != p.shape[0] else p for p, w in zip(parts, plan.widths)]
    flat = padded[0] if len(padded) == 1 else jnp.concatenate(padded)
    return flat.reshape(key.shape)


def _take(result: Any, index: tuple[str, int, int]) -> Any:
    kind, start, stop = index
    if kind == "cols":
        return result[:, start:stop].reshape(-1)
    return result.reshape(-1)[start:stop]


def _write(flat: Any, view: View, value: Any) -> Any:
    import jax
    import jax.numpy as jnp

    import tpudist.ops as tops
    from tpudist.device import interop, views

    want = tops.to_jax_dtype(view.dtype)
    if view.pairs:
        value = value.reshape(*view.sizes, 2)
        value = jax.lax.complex(value[..., 0], value[..., 1])
    value = (value != 0) if want == jnp.bool_ else value.astype(want)
    value = interop.retype(value.reshape(view.sizes), flat.dtype)
    return views.write(flat, value, view.sizes, view.strides, view.offset)


def _join(key: ProgramKey, me: int, lowering: Any, block: Any, outs: list) -> Any:
    """The op's result from the lowering's outputs, as ``Lowering.join`` makes it on the host: the
    direct lowerings' output ``k - 1`` came from the rank ``k`` places before ours (lowerings.py)."""
    n = len(key.group)
    if key.op == "all_reduce":
        numel = math.prod(key.shape)
        return _place(outs[0], outs[1:], me, n).reshape(-1)[:numel].reshape(key.shape)
    if key.op == "all_gather":
        return _place(block, outs, me, n)
    if key.op == "all_to_all":
        return _place(block[me], outs, me, n)
    return lowering.join(block, outs, None)


def _place(own: Any, outs: list, me: int, n: int) -> Any:
    import jax.numpy as jnp

    rows = [None] * n
    rows[me] = own
    for k, out in enumerate(outs, start=1):
        rows[(me - k) % n] = out
    return jnp.stack(rows)
