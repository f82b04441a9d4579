"""Process-wide device state: the JAX device, the lock, the eager mode, the RNG, the counters.

Nothing here touches JAX until the first tensor needs the device: in a "tpu" process-group world
``jax.distributed.initialize`` must run before any JAX backend starts, so the device is looked up
lazily (the rank's chip once the process group booted JAX, else ``jax.local_devices()[0]``).
Backward runs on autograd's device thread, so all state is process-global and guarded by ``LOCK``.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter

from torch import Generator as _TorchGenerator

from tpudist.runtime import chip
from tpudist.runtime.jax_cache import enable_persistent_cache

LOCK = threading.RLock()


class EagerMode(str):
    """An eager mode: its name (a ``str``: a user's ``torch.tpu.get_eager_mode()`` still equals "fused") and
    what the device does in it, asked by name at each call site, never by comparing strings:

    - ``records``: an op is recorded into the pending graph, run as one program at a boundary (Fused);
      else each op runs its own kernel at once (Strict, Debug).
    - ``checks``: each op's arguments are checked, each kernel waited for (errors at the op that raised
      them) and NaNs can be looked for (Debug).
    """

    records = False
    checks = False


class _Debug(EagerMode):
    checks = True


class _Fused(EagerMode):
    records = True


DEBUG, STRICT, FUSED = _Debug("debug"), EagerMode("strict"), _Fused("fused")
MODES = {m: m for m in (DEBUG, STRICT, FUSED)}  # name -> mode (a mode is its own name)
_MODE_ENV = "TPUDIST_EAGER_MODE"

_device = None
_mode: EagerMode | None = None
_nan_check = os.environ.get("TPUDIST_DEBUG_NANS", "") == "1"
_cpu_fallback = os.environ.get("TPUDIST_CPU_FALLBACK", "") == "1"
_DYNAMIC_ENV = "TPUDIST_DYNAMIC_SCALARS"
_dynamic_scalars = os.environ.get(_DYNAMIC_ENV, "1") != "0"
peak_bytes = 0  # the highest memory_allocated() seen (torch.tpu.max_memory_allocated)
peak_reserved_bytes = 0  # the highest memory_reserved() seen (torch.tpu.max_memory_reserved)
allocator_peak_at_reset = 0  # JAX's peak_bytes_in_use at the last reset_peak_memory_stats (it never resets)
stats = Counter()
fallback_ops = Counter()
_warned: set[str] = set()


class DeviceInitError(RuntimeError):
    """The tpu device was used in a way that prevents the JAX runtime from starting."""


def device():
    """The JAX device behind "tpu" (looked up on first use, never at import)."""
    global _device
    if _device is not None:
        return _device
    with LOCK:
        if _device is not None:
            return _device
        _device = chip.local_device()
        if _device is None:
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if world > 1:
                raise DeviceInitError(
                    f"the tpu device was used before torch.distributed.init_process_group(\"tpu\") in a "
                    f"world of WORLD_SIZE={world}: JAX's distributed runtime must start before any JAX "
                    "backend, and using the device starts one. Call init_process_group(\"tpu\") before "
                    "creating tpu tensors (or unset WORLD_SIZE for a single-process run).")
            from tpudist.mesh import tpu_env

            if tpu_env.platform() == "tpu":
                tpu_env.configure_process(0, 1)  # chip 0 alone, set before JAX's TPU backend starts
            import jax

            _device = jax.local_devices()[0]
        enable_persistent_cache()
        return _device


def reset_device() -> None:
    """Forget the device (after the process group's world was destroyed)."""
    global _device
    _device = None


def follow_process_group() -> None:
    """The process group booted or shut down its JAX runtime (``group.py`` calls this).

    Booted: the device is rank r's chip from now on, and is "initialized", so torch's DeviceMesh
    does not ``set_device(LOCAL_RANK)`` (each process drives one chip, always ``tpu:0``). Shut down:
    the chip belonged to the old world's backends, so the next use looks it up again.
    """
    global _device
    with LOCK:
        _device = chip.local_device()
        if _device is not None:
            enable_persistent_cache()  # device() returns this chip without looking it up (and enabling)


def get_mode() -> EagerMode:
    global _mode
    if _mode is None:
        value = os.environ.get(_MODE_ENV, "strict").lower()
        if value not in MODES:
            raise ValueError(f"{_MODE_ENV}={value!r} is not an eager mode: use one of {', '.join(MODES)}")
        _mode = MODES[value]
    return _mode


def set_mode(mode: str) -> None:
    """Sets the eager mode by name ("debug", "strict", "fused") or as an ``EagerMode``."""
    global _mode
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode={mode!r} is not an eager mode: use one of {', '.join(MODES)}")
    _mode = MODES[mode]


def nan_check() -> bool:
    return _nan_check


def set_nan_check(on: bool) -> None:
    global _nan_check
    _nan_check = bool(on)


def cpu_fallback() -> bool:
    if os.environ.get("TPUDIST_STRICT_OPS", "") == "1":
        return False
    return _cpu_fallback


def set_cpu_fallback(on: bool) -> None:
    global _cpu_fallback
    if on and os.environ.get("TPUDIST_STRICT_OPS", "") == "1":
        raise ValueError("TPUDIST_STRICT_OPS=1 forbids the CPU fallback; unset it to allow ops without a "
                         "lowering to run on the CPU")
    _cpu_fallback = bool(on)


def dynamic_scalars() -> bool:
    return _dynamic_scalars


def set_dynamic_scalars(on: bool) -> bool:
    """Turn automatic dynamic ints on or off; returns the previous setting.

    On (the default; env ``TPUDIST_DYNAMIC_SCALARS=0`` starts off): an int argument, 0-dim int CPU
    tensor or view storage offset that takes a second value at the same place of an op becomes a
    runtime input of its kernel, and an int tensor that grows by ``cat`` at the same place gets a
    storage of bucketed capacity (``tpudist.device.buckets.growth()``). ``torch.tpu.cache_stats()``
    counts them: ``dynamic_ints``, ``dynamic_ints_refused`` (ints that decide a shape, kept constant)
    and ``growing_tensors``.

    Example:
        >>> import tpudist.device
        >>> previous = tpudist.device.set_dynamic_scalars(False)   # every int a constant again
        >>> _ = tpudist.device.set_dynamic_scalars(previous)
    """
    global _dynamic_scalars
    previous, _dynamic_scalars = _dynamic_scalars, bool(on)
    return previous


def warn_fallback(name: str) -> None:
    fallback_ops[name] += 1
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"aten op {name} has no JAX lowering: it ran on the CPU (copying its tensors to the "
                      "host and back). Add a lowering with @tpudist.ops.lowers to keep it on the device.",
                      stacklevel=4)


_SEED_MASK = 0xFFFFFFFF  # keys are jax.random.key(uint32 seed): the seed's low 32 bits
DEFAULT_SEED = 67280421310721  # torch's default seed (c10::default_rng_seed_val), as CPU's and CUDA's generators
_generator = None  # the tpu torch.Generator the running op draws from; None: the default stream
_drawn = False  # whether the running op drew from _generator


class HostStream:
    """The default stream where the C++ hooks (and so the device's default ``torch.Generator``) are missing:
    a seed and an offset behind the part of the Generator API the device uses."""

    def __init__(self):
        self._seed, self._offset = DEFAULT_SEED, 0

    def initial_seed(self) -> int:
        return self._seed

    def manual_seed(self, value: int) -> HostStream:
        self._seed, self._offset = int(value) & 0xFFFFFFFFFFFFFFFF, 0  # torch's remapping of negative seeds
        return self

    def seed(self) -> int:
        import random

        self.manual_seed(random.getrandbits(64))
        return self._seed

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> None:
        self._offset = int(offset)

    def get_state(self):
        import torch

        return torch.tensor([self._seed, self._offset], dtype=torch.uint64).view(torch.uint8)

    def set_state(self, state) -> None:
        import torch

        if state.dtype != torch.uint8 or state.numel() != 16:
            raise RuntimeError(f"a tpu random state is 16 bytes of torch.uint8 (seed and offset, as get_rng_state "
                               f"returns them); got {state.numel()} elements of {state.dtype}")
        self._seed, self._offset = (int(v) for v in state.view(torch.uint64).tolist())


default = HostStream()  # the device's default stream: torch.tpu.default_generators[0] with the C++ hooks


def use_default_generator(generator) -> None:
    """Make ``generator`` (the C++ hooks' ``getDefaultGenerator``) the device's default stream."""
    global default
    default = generator


def next_rng(args=()) -> tuple[int, int]:
    """(seed, offset) of the running random op: the key is fold_in(key(seed), offset), where offset counts
    the ops drawn from the op's generator (its ``generator=``, else the default stream) since its seed, this
    one included. ``args`` are the op's positional arguments: a few ops (``poisson``, ``rrelu_with_noise``)
    take their generator there. A generator seeded s draws what the default stream seeded s draws."""
    global _drawn
    generator = _generator
    if generator is None:
        for a in args:  # a loop, not next(genexpr): this runs for every random op (~8x cheaper)
            if a.__class__ is _TorchGenerator:
                _check_device(a, "a random op taking its generator positionally")
                generator = a
                break
    if generator is not None:
        _drawn = True
    else:
        generator = default
    offset = generator.get_offset() + 1
    generator.set_offset(offset)
    return generator.initial_seed() & _SEED_MASK, offset


def manual_seed(value: int) -> None:
    default.manual_seed(int(value))


def _check_device(generator, op) -> None:
    if generator.device.type != "tpu":
        raise RuntimeError(
            f"Expected a 'tpu' device type for generator but found '{generator.device.type}': {op} on tpu "
            "tensors draws from a generator of the device, torch.Generator(device='tpu').manual_seed(seed) "
            "(or pass no generator: the device's default stream, seeded by torch.manual_seed)")


def run_with_generator(run, op, args, kwargs):
    """``run(op, args, kwargs)`` with ``kwargs["generator"]`` (a torch.Generator) set to None: the op's
    random numbers come from that generator's stream, and the default stream does not move. Call it
    holding ``LOCK``. A generator of another device raises, as CUDA's ops do; an op that ran without
    drawing from the generator (the CPU fallback) raises rather than return another stream's numbers."""
    global _generator, _drawn
    generator = kwargs["generator"]
    _check_device(generator, op)
    saved = _generator, _drawn
    _generator, _drawn = generator, False
    try:
        result = run(op, args, {**kwargs, "generator": None})  # required in the .generator overloads
        if not _drawn:
            raise NotImplementedError(
                f"{op} with generator= ran without drawing from the generator (an op run by the CPU fallback "
                "draws from CPU's stream): its result does not come from the generator's stream. Pass no "
                "generator, or draw on CPU with a CPU generator and move the result to the device.")
    finally:
        _generator, _drawn = saved
    return result


def _follow_a_booted_process_group() -> None:
    """``import tpudist.device`` after ``init_process_group("tpu")``: the chip is known already."""
    if chip.local_device() is not None:
        follow_process_group()


_follow_a_booted_process_group()
