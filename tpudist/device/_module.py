"""``torch.tpu``: the device module torch (and DCP, FSDP2, autocast, torch.manual_seed) looks up.

One JAX device per process (one process per chip), so ``device_count()`` is 1 and the index is 0.
"""

from __future__ import annotations

import contextlib
import types

import torch

from tpudist.device import _oom
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
    """The chip's product name, as ``torch.cuda.get_device_name``: JAX's ``device_kind`` ("TPU v5p"; "cpu"
    when emulating on the CPU backend)."""
    return rt.device().device_kind


def synchronize(device=None) -> None:
    """Run pending fused work and wait for every dispatched program."""
    import jax

    from tpudist.device import _fused

    with rt.LOCK:
        _fused.flush()
    try:
        # one batched wait (JAX's C++), not a Python loop over them: 0.11 -> 0.035 ms for 229 arrays on CPU
        jax.block_until_ready(jax.live_arrays())
    except jax.errors.JaxRuntimeError as e:  # a dispatched program ran out of memory after its call returned
        _oom.raise_if_oom(e, "a dispatched program (seen at torch.tpu.synchronize)", None)
        raise


def manual_seed(seed: int) -> None:
    with rt.LOCK:
        rt.manual_seed(seed)


manual_seed_all = manual_seed


def seed() -> None:
    with rt.LOCK:
        rt.default.seed()


seed_all = seed


def initial_seed() -> int:
    return rt.default.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    """The default stream's state: 16 bytes, its seed and the number of random ops drawn since (a tpu
    ``torch.Generator``'s state)."""
    with rt.LOCK:
        return rt.default.get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    with rt.LOCK:
        rt.default.set_state(state)


def get_rng_state_all() -> list:
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    set_rng_state(states[0])


# -- memory ------------------------------------------------------------------------------------------
# Where JAX reports the device's allocator (TPU: ``Device.memory_stats()``), its numbers are used; XLA:CPU
# reports nothing (jax 0.10.2: None), so the emulated chip counts the bytes of the live jax.Arrays on its
# device (every tpu storage is one; JAX frees a buffer when its last array dies, so nothing is cached:
# reserved == allocated). JAX's peak (``peak_bytes_in_use``, since the process started) cannot be reset:
# after a reset it counts once it rises above its value at the reset (a new high since then), else the
# peak is the highest value these functions sampled since the reset. On CPU the peak is always sampled.


def _allocator_stats() -> dict:
    """JAX's allocator statistics of this process's device ({} where the backend reports none: CPU)."""
    return rt.device().memory_stats() or {}


def _live_bytes() -> int:
    import jax

    dev = rt.device()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and dev in a.devices())


def _sample() -> tuple[int, int]:
    """(allocated, reserved) bytes now; updates the peaks."""
    stats = _allocator_stats()
    allocated = stats.get("bytes_in_use", None)
    if allocated is None:
        allocated = _live_bytes()
    reserved = stats.get("bytes_reserved", stats.get("pool_bytes", allocated)) or allocated
    allocator_peak = stats.get("peak_bytes_in_use", 0)
    rose = allocator_peak > rt.allocator_peak_at_reset  # a new high since the reset: the peak since it
    rt.peak_bytes = max(rt.peak_bytes, allocated, allocator_peak if rose else 0)
    rt.peak_reserved_bytes = max(rt.peak_reserved_bytes, reserved)
    return allocated, reserved


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM (Linux /proc/meminfo), where the CPU backend's arrays live."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available, total


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of device memory, as ``torch.cuda.mem_get_info``.

    TPU: JAX's ``bytes_limit`` minus ``bytes_in_use``. CPU emulation: the host's available and total
    RAM (MemAvailable), which the emulated chips share.
    """
    stats = _allocator_stats()
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), stats["bytes_limit"]
    return _host_memory()


_oom.on_memory_info(lambda: (memory_allocated(), *mem_get_info()))


def memory_allocated(device=None) -> int:
    """Bytes in use on this process's device: JAX's ``bytes_in_use`` on TPU, else the bytes of the live
    jax.Arrays on the device (CPU emulation).

    Example:
        >>> before = torch.tpu.memory_allocated()
        >>> x = torch.ones(2**20, device="tpu")        # 4 MiB of float32
        >>> torch.tpu.memory_allocated() - before >= 4 * 2**20
        True
    """
    return _sample()[0]


def max_memory_allocated(device=None) -> int:
    """The highest ``memory_allocated()`` since the start or the last ``reset_peak_memory_stats``: on TPU
    JAX's ``peak_bytes_in_use`` where it rose since the reset (peaks inside a program included), else the
    highest value these functions sampled (always so on CPU emulation)."""
    _sample()
    return rt.peak_bytes


def memory_reserved(device=None) -> int:
    """Bytes the allocator holds: JAX's ``bytes_reserved`` (or ``pool_bytes``) where reported, else equal to
    ``memory_allocated()`` (XLA:CPU keeps no cache of freed buffers)."""
    return _sample()[1]


def max_memory_reserved(device=None) -> int:
    """The highest ``memory_reserved()`` sampled since the start or the last ``reset_peak_memory_stats``."""
    _sample()
    return rt.peak_reserved_bytes


def reset_peak_memory_stats(device=None) -> None:
    """Restart the peaks of ``max_memory_allocated``/``max_memory_reserved`` (and memory_stats' peaks) now."""
    rt.peak_bytes = rt.peak_reserved_bytes = 0
    rt.allocator_peak_at_reset = _allocator_stats().get("peak_bytes_in_use", 0)
    _sample()


reset_max_memory_allocated = reset_peak_memory_stats


def memory_stats(device=None) -> dict:
    """``torch.cuda.memory_stats``'s keys that training tools read (torchtitan, accelerate, HF Trainer).

    - ``allocated_bytes.all.{current,peak}`` and ``active_bytes.all.{current,peak}``: ``memory_allocated()``
      and its peak (no block is allocated but inactive: the two are equal);
    - ``reserved_bytes.all.{current,peak}``: ``memory_reserved()`` and its peak;
    - ``num_alloc_retries``: 0, always: there is no caching allocator that frees its cache and retries;
    - ``num_ooms``: how many ``torch.OutOfMemoryError`` were raised so far (XLA's RESOURCE_EXHAUSTED at
      an op, a sync, a compiled program or a copy to the device);
    - ``num_device_alloc``: JAX's ``num_allocs`` where reported (TPU); absent on CPU emulation.

    Example:
        >>> torch.tpu.memory_stats()["active_bytes.all.peak"] >= torch.tpu.memory_allocated()
        True
    """
    allocated, reserved = _sample()
    stats = {
        "allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": rt.peak_bytes,
        "active_bytes.all.current": allocated, "active_bytes.all.peak": rt.peak_bytes,
        "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": rt.peak_reserved_bytes,
        "num_alloc_retries": 0, "num_ooms": rt.stats["ooms"],
    }
    allocator = _allocator_stats()
    if "num_allocs" in allocator:
        stats["num_device_alloc"] = allocator["num_allocs"]
    return stats


def empty_cache() -> None:
    """Nothing to release: JAX frees a device buffer as soon as its last array dies (no torch-style cache)."""
    return None


def clear_kernel_cache() -> None:
    """Drops what this process compiled for the device, in host memory: per-op kernels, Fused programs,
    what the automatic dynamic ints and the growing tensors learned, and JAX's own compiled programs.
    Pending Fused work runs first; tensors stay valid. The next op compiles again (from the persistent
    compile cache on disk where it holds the program). For long-lived processes that run many unrelated
    models, such as a test suite's workers: each kernel keeps its XLA executable until then."""
    import jax

    from tpudist.device import _core, _fused, _grow

    with rt.LOCK:
        _fused.flush()
        for cache in (_core._KERNELS, _core._SITES, _core._HINTS, _fused._PROGRAMS,  # noqa: SLF001
                      *(getattr(_grow, name) for name in _grow.LEARNED)):
            cache.clear()
        jax.clear_caches()


# -- properties ----------------------------------------------------------------------------------------


class DeviceProperties:
    """What ``torch.tpu.get_device_properties`` returns; the fields torch.cuda's object has that tools read.

    - ``name``: JAX's ``device_kind`` ("TPU v5p", "TPU v5 lite", or "cpu" when emulating on CPU);
    - ``total_memory``: bytes of device memory: JAX's ``bytes_limit`` (TPU), or the host's RAM (CPU
      emulation: the emulated chips' arrays live there);
    - ``multi_processor_count``: TensorCores behind this device (JAX's ``num_cores``, 1 where it does not
      say); on CPU emulation the CPU threads this process may run on;
    - ``major``, ``minor``: the TPU generation ("TPU v5p" -> (5, 0)); (0, 0) on CPU emulation;
    - ``platform``: "tpu" or "cpu" (JAX's platform), ``is_emulated``: True on the CPU backend.
    """

    __slots__ = ("name", "total_memory", "multi_processor_count", "major", "minor", "platform", "is_emulated")

    def __init__(self, name, total_memory, multi_processor_count, major, minor, platform):
        self.name, self.total_memory = name, int(total_memory)
        self.multi_processor_count, self.major, self.minor = int(multi_processor_count), major, minor
        self.platform, self.is_emulated = platform, platform != "tpu"

    def __repr__(self):
        return (f"_TpuDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"multi_processor_count={self.multi_processor_count}, platform='{self.platform}')")


def _generation(kind: str) -> tuple[int, int]:
    import re

    found = re.search(r"v(\d+)", kind)
    return (int(found.group(1)), 0) if found else (0, 0)


def get_device_properties(device=None) -> DeviceProperties:
    """The properties of this process's device (see ``DeviceProperties`` for each field's source).

    Example:
        >>> props = torch.tpu.get_device_properties()
        >>> props.total_memory > 0
        True
    """
    import os

    _check_index(device)
    dev = rt.device()
    stats = _allocator_stats()
    if dev.platform == "tpu":
        total, cores = stats.get("bytes_limit", 0), getattr(dev, "num_cores", 1)
    else:
        total, cores = _host_memory()[1], len(os.sched_getaffinity(0))
    return DeviceProperties(dev.device_kind, total, cores, *_generation(dev.device_kind), dev.platform)


def get_device_capability(device=None) -> tuple[int, int]:
    """(major, minor) of ``get_device_properties``: the TPU generation, (0, 0) on CPU emulation."""
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """XLA computes bfloat16 on every backend (natively on TPU)."""
    return True


def _check_index(device) -> None:
    if device is None:
        return
    index = device if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise ValueError(f"device index {index} does not exist: each process drives one chip (tpu:0)")


def _get_device_index(device, optional: bool = False, allow_cpu: bool = False) -> int:
    """The index in ``device`` (an int, "tpu", "tpu:0", a ``torch.device``), as torch.cuda's helper that
    ``torch.load(map_location="tpu")`` calls; -1 for a CPU device when ``allow_cpu``."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cpu" and allow_cpu:
            return -1
        if device.type != "tpu":
            raise ValueError(f"expected a tpu device, got {device}")
        device = device.index
    if device is None:
        if not optional:
            raise ValueError("expected a tpu device with an index (tpu:0), got none")
        return current_device()
    _check_index(device)
    return device


_utils = types.SimpleNamespace(_get_device_index=_get_device_index)

# The runtime starts at the first tpu op, not at import: what torch (checkpointing) reads as "the device
# is in use, stash its RNG state", which any tpu tensor argument already implies.
_initialized = True


class device:
    """Context manager that selects a device, as ``torch.cuda.device``: each process drives one chip, so
    tpu:0 (or None, or -1 for "no change") is the only index; torch's checkpointing and ``torch.load``
    enter it around RNG-state and storage moves."""

    def __init__(self, device):
        self.idx = _get_device_index(device, optional=True) if device not in (None, -1) else -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def device_of(obj) -> device:
    """The device of tensor ``obj`` as a context manager (a no-op for a CPU tensor)."""
    return device(obj.get_device() if obj.device.type == "tpu" else -1)


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
    """Counters: kernels compiled (strict/debug), fused programs, readers of values to the host
    (one per view geometry), cache hits/misses, CPU fallbacks."""
    from tpudist.device import _fused

    stats = {"kernels": 0, "hits": 0, "misses": 0, "ops": 0, "recorded_ops": 0, "programs": 0, "syncs": 0,
             "readers": 0, "compile_s": 0.0, "graph_key_s": 0.0}
    stats.update(rt.stats)
    stats["pending_ops"] = _fused.pending_ops()
    stats["recorded_ops"] += stats["pending_ops"]  # the graph counts its ops when it runs
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
    """A point in the device's work, as ``torch.cuda.Event``.

    JAX exposes no device timestamps, so a timing event (``enable_timing=True``) waits, when recorded,
    for the work dispatched so far (pending fused work runs first) and then reads the host clock:
    ``elapsed_time`` is the milliseconds between the completion points of the two recordings. Recording
    a timing event is therefore a sync point. An event without timing records without waiting.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time = None
        self._recorded = False

    def record(self, stream=None) -> None:
        import time

        if self.enable_timing:
            synchronize()
            self._time = time.perf_counter()
        self._recorded = True

    def synchronize(self) -> None:
        if self._recorded:
            synchronize()

    def wait(self, stream=None) -> None:
        return None  # one in-order stream: later work already follows the recorded work

    def query(self) -> bool:
        """True when the work recorded so far has completed (always, for a recorded timing event)."""
        import jax

        if not self._recorded or self._time is not None:
            return True
        return all(a.is_ready() for a in jax.live_arrays())

    def elapsed_time(self, end) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        if self._time is None or end._time is None:  # noqa: SLF001
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._time - self._time) * 1000.0  # noqa: SLF001


_DEFAULT_STREAM = Stream()


def current_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(s=None):
    yield s


default_generators: tuple = ()  # (the device's default torch.Generator,) with the C++ hooks, as torch.cuda's


def build_module() -> types.ModuleType:
    module = types.ModuleType("torch.tpu", __doc__)
    for name, value in list(globals().items()):
        if not name.startswith("__") and name not in ("build_module", "use_default_generator", "contextlib", "types",
                                                      "torch", "rt"):
            setattr(module, name, value)
    return module


def use_default_generator(module: types.ModuleType, generator: torch.Generator) -> None:
    """The C++ hooks' default generator becomes the device's default stream and ``torch.tpu.default_generators``."""
    rt.use_default_generator(generator)
    module.default_generators = (generator,)
