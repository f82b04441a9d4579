"""``torch.tpu``: the device module torch (and DCP, FSDP2, autocast, torch.manual_seed) looks up.

One JAX device per process (one process per chip), so ``device_count()`` is 1 and the index is 0.
"""

from __future__ import annotations

import contextlib
import types

import torch

from tpudist.device import _runtime as rt


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return rt._device is not None  # noqa: SLF001


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    rt.device()


def init() -> None:
    rt.device()


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device) -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    if index not in (None, 0):
        raise ValueError(f"device index {index} does not exist: each process drives one chip (tpu:0); "
                         "start one process per chip (torchrun --nproc-per-node N)")


def get_device_name(device=None) -> str:
    return str(rt.device())


def synchronize(device=None) -> None:
    """Run pending fused work and wait for every dispatched program."""
    import jax

    from tpudist.device import _fused

    with rt.LOCK:
        _fused.flush()
    for array in jax.live_arrays():
        array.block_until_ready()


def manual_seed(seed: int) -> None:
    with rt.LOCK:
        rt.manual_seed(seed)


manual_seed_all = manual_seed


def seed() -> None:
    import random

    manual_seed(random.getrandbits(32))


seed_all = seed


def initial_seed() -> int:
    return rt.seed


def get_rng_state(device=None) -> torch.Tensor:
    return torch.tensor([rt.seed, rt.counter], dtype=torch.int64).view(torch.uint8)


def set_rng_state(state: torch.Tensor, device=None) -> None:
    seed_value, count = state.view(torch.int64).tolist()
    with rt.LOCK:
        rt.seed, rt.counter = int(seed_value), int(count)


def get_rng_state_all() -> list:
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    set_rng_state(states[0])


def memory_allocated(device=None) -> int:
    """Bytes of live JAX buffers on this process's device (every tpu storage is one)."""
    import jax

    dev = rt.device()
    total = sum(a.nbytes for a in jax.live_arrays() if dev in a.devices())
    rt.peak_bytes = max(rt.peak_bytes, total)
    return total


def max_memory_allocated(device=None) -> int:
    memory_allocated()
    return rt.peak_bytes


def reset_peak_memory_stats(device=None) -> None:
    rt.peak_bytes = 0
    memory_allocated()


def empty_cache() -> None:
    return None


def set_eager_mode(mode: str) -> None:
    """"debug" | "strict" | "fused" for this process (default: $TPUDIST_EAGER_MODE or "strict")."""
    from tpudist.device import _fused

    with rt.LOCK:
        _fused.flush()
        rt.set_mode(mode)


def get_eager_mode() -> str:
    return rt.get_mode()


@contextlib.contextmanager
def eager_mode(mode: str):
    """Run the block in ``mode``, then restore the previous mode (pending fused work runs at both ends)."""
    previous = get_eager_mode()
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def set_nan_check(on: bool) -> None:
    """Debug mode only: raise FloatingPointError at the first op producing a NaN."""
    rt.set_nan_check(on)


def set_cpu_fallback(on: bool) -> None:
    """Let ops with no lowering run on the CPU (counted, warned once per op); off by default."""
    rt.set_cpu_fallback(on)


def cache_stats() -> dict:
    """Counters: kernels compiled (strict/debug), fused programs, cache hits/misses, CPU fallbacks."""
    from tpudist.device import _fused

    stats = {"kernels": 0, "hits": 0, "misses": 0, "ops": 0, "recorded_ops": 0, "programs": 0, "syncs": 0,
             "compile_s": 0.0, "graph_key_s": 0.0}
    stats.update(rt.stats)
    stats["pending_ops"] = _fused.pending_ops()
    stats["cpu_fallback_ops"] = dict(rt.fallback_ops)
    stats["mode"] = rt.get_mode()
    return stats


def get_amp_supported_dtype() -> list:
    return [torch.bfloat16, torch.float16]


class Stream:
    """A stream handle: JAX orders work itself, so every stream is the default stream."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.priority = priority

    @property
    def device(self):
        return torch.device("tpu", 0)

    def synchronize(self) -> None:
        synchronize()

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Stream)

    def __hash__(self):
        return hash("tpu-stream")


class Event:
    def __init__(self, enable_timing: bool = False, **kwargs):
        self._time = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def synchronize(self) -> None:
        synchronize()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return (end._time - self._time) * 1000.0  # noqa: SLF001


_DEFAULT_STREAM = Stream()


def current_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(s=None):
    yield s


def build_module() -> types.ModuleType:
    module = types.ModuleType("torch.tpu", __doc__)
    for name, value in list(globals().items()):
        if not name.startswith("__") and name not in ("build_module", "contextlib", "types", "torch", "rt"):
            setattr(module, name, value)
    return module
