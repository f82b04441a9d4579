"""Device memory: ``torch.tpu.memory_*`` numbers, and out-of-memory as ``torch.OutOfMemoryError``.

On CPU, XLA's RESOURCE_EXHAUSTED is simulated where the device meets XLA (a kernel's run, a fused
program's compile or run, a copy to the device, a compiled graph's program): the error must come out
as ``torch.OutOfMemoryError`` naming the sizes and the fix, with every tensor made before it intact
and the next op working. The ``chip`` tests run only on a TPU (they allocate past its HBM for real):

    python -m pytest -q -p no:cacheprovider tests/device/test_device_memory.py
"""

from __future__ import annotations

import gc

import jax
import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _core, _fused, _storage

GiB = 2**30
XLA_OOM = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 20.00G. That was not "
           "possible. There are 15.46G free.")


def _raise_oom(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(XLA_OOM)


def _assert_names_sizes_and_fix(e: torch.OutOfMemoryError, what: str) -> None:
    text = str(e)
    assert text.startswith("tpu out of memory: "), text
    assert what in text, (what, text)
    for part in ("in_use=", "free=", "limit=", "GiB", "XLA: RESOURCE_EXHAUSTED", "To fit: free tensors"):
        assert part in text, (part, text)
    assert isinstance(e, torch.cuda.OutOfMemoryError)  # what code that catches a CUDA OOM catches
    assert isinstance(e.__cause__, jax.errors.JaxRuntimeError)


def _kernel_of(op, shape) -> _core.Kernel:
    """The Strict kernel of ``op`` whose result has ``shape`` (each test's shapes are its own)."""
    found = [k for k in _core._KERNELS.values()  # noqa: SLF001
             if isinstance(k, _core.Kernel) and k.op == op and any(tuple(s) == shape for s, *_ in k.fresh or ())]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_a_strict_op_out_of_memory_is_torch_oom_and_nothing_is_lost(mode, monkeypatch):
    keep = torch.arange(10.0).to("tpu") * 2
    x = torch.ones(7, 13, device="tpu")
    x.add(1.5)  # builds the kernel this test makes fail
    kernel = _kernel_of(torch.ops.aten.add.Tensor, (7, 13))
    ooms = torch.tpu.memory_stats()["num_ooms"]
    monkeypatch.setattr(kernel, "jitted", _raise_oom)
    monkeypatch.setattr(kernel, "jitted_plain", _raise_oom)
    with pytest.raises(torch.OutOfMemoryError) as info:
        x.add(2.5)
    _assert_names_sizes_and_fix(info.value, "aten.add.Tensor needs more device memory than is free: "
                                            f"requested=0.00 GiB ({7 * 13 * 4} bytes) (its results)")
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    monkeypatch.undo()
    assert torch.equal(x.cpu(), torch.ones(7, 13)) and torch.equal(keep.cpu(), torch.arange(10.0) * 2)
    assert torch.equal(x.add(2.5).cpu(), torch.full((7, 13), 3.5))


@pytest.mark.parametrize("where", ["compile", "run"])
@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_a_fused_sync_out_of_memory_is_torch_oom_and_written_storages_keep_their_values(mode, where, monkeypatch):
    """A program that does not fit fails at its compile ("Ran out of memory in memory space hbm") or at
    its run; either way the sync raises, and storages the graph wrote in place hold their values of
    before the graph, as if its ops had not been recorded."""
    cols = 11 if where == "compile" else 12  # each case its own graph: a program built before would hide it
    w = torch.ones(5, cols).to("tpu")   # a concrete storage the graph writes in place
    keep = torch.arange(6.0).to("tpu")
    full = [True]  # the chip: full while the failing sync runs, then memory was freed
    if where == "compile":
        monkeypatch.setattr(_fused, "_load_or_compile", _raise_oom)
    else:
        compile_program = _fused._load_or_compile

        def program_that_runs_when_memory_is_free(g, live, sc, shapes=None):
            program = compile_program(g, live, sc, shapes)
            return lambda *args: _raise_oom() if full[0] else program(*args)

        monkeypatch.setattr(_fused, "_load_or_compile", program_that_runs_when_memory_is_free)
    w.mul_(3.0)
    z = w + 1
    with pytest.raises(torch.OutOfMemoryError) as info:
        z.cpu()
    _assert_names_sizes_and_fix(info.value, "the fused program of 2 ops (run at this sync point) needs more "
                                            f"device memory than is free: requested=0.00 GiB ({2 * 5 * cols * 4} bytes)")
    assert _fused.pending_ops() == 0
    full[0] = False
    monkeypatch.undo()
    assert torch.equal(w.cpu(), torch.ones(5, cols)) and torch.equal(keep.cpu(), torch.arange(6.0))
    w.mul_(3.0)
    assert torch.equal((w + 1).cpu(), torch.full((5, cols), 4.0))


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_a_copy_to_the_device_past_its_memory_is_torch_oom(mode, monkeypatch):
    """A fake chip of 4 KiB: ``.to("tpu")`` of more raises; a smaller copy then works."""
    device_put = jax.device_put

    def small_chip(x, device=None, **kwargs):
        if getattr(x, "nbytes", 0) > 4096:
            _raise_oom()
        return device_put(x, device, **kwargs)

    monkeypatch.setattr(jax, "device_put", small_chip)
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.ones(2000).to("tpu")
    _assert_names_sizes_and_fix(info.value, "copying a (2000,) torch.float32 tensor to the device needs more "
                                            "device memory than is free: requested=0.00 GiB (8000 bytes)")
    assert torch.equal(torch.ones(1000).to("tpu").cpu(), torch.ones(1000))


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_a_compiled_graph_out_of_memory_is_torch_oom(mode, monkeypatch):
    from tpudist.compile import device_io

    torch._dynamo.reset()
    f = torch.compile(lambda a: (a * 2).sin(), backend="tpu", fullgraph=True, dynamic=False)
    a = torch.ones(3, 17).to("tpu")
    want = f(a).cpu()
    monkeypatch.setattr(device_io, "program_input", _raise_oom)
    with pytest.raises(torch.OutOfMemoryError) as info:
        f(a)
    _assert_names_sizes_and_fix(info.value, f"graph's program needs more device memory than is free: "
                                            f"requested=0.00 GiB ({3 * 17 * 4} bytes)")
    monkeypatch.undo()
    assert torch.equal(f(a).cpu(), want) and torch.equal(a.cpu(), torch.ones(3, 17))


def test_other_runtime_errors_are_not_oom(monkeypatch):
    """Only XLA's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError."""
    def other(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(jax, "device_put", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else") as info:
        _storage.to_jax(torch.ones(3))
    assert not isinstance(info.value, torch.OutOfMemoryError)


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_memory_allocated_counts_a_tensor_and_returns_it(mode):
    torch.ones(2**20, device="tpu").sum().item()  # its program loaded first: on a TPU the allocator counts
    # programs too
    gc.collect()  # earlier tests' cyclic garbage (compiled graphs) freed mid-test would shrink the count
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    t = torch.ones(2**20, device="tpu")  # 4 MiB of float32
    grown = torch.tpu.memory_allocated() - before
    assert 4 * 2**20 <= grown < 5 * 2**20, grown
    assert torch.tpu.max_memory_allocated() >= before + 4 * 2**20
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated()
    del t
    torch.tpu.synchronize()  # on a TPU the memory comes back once the program writing it has ended
    assert torch.tpu.memory_allocated() - before < 2**20
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() < before + 2**20
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total


# -- on the chip --------------------------------------------------------------------------------------

def _chip():
    if jax.devices()[0].platform != "tpu":
        pytest.skip(f"needs a TPU chip (jax.devices()[0].platform={jax.devices()[0].platform!r}): "
                    "allocates past the chip's HBM for real")


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_chip_memory_numbers_are_the_allocators(mode):
    _chip()
    stats = jax.devices()[0].memory_stats()
    assert {"bytes_in_use", "peak_bytes_in_use", "bytes_limit"} <= set(stats), stats
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    t = torch.ones(2**28, device="tpu")  # 1 GiB of float32
    torch.tpu.synchronize()
    grown = torch.tpu.memory_allocated() - before
    assert GiB <= grown < GiB + 64 * 2**20, grown
    assert torch.tpu.max_memory_allocated() >= before + GiB
    free, total = torch.tpu.mem_get_info()
    assert total == jax.devices()[0].memory_stats()["bytes_limit"] and free <= total - GiB
    assert torch.tpu.memory_stats()["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    del t
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() - before < 16 * 2**20
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() < before + 16 * 2**20  # the 1 GiB peak was before the reset
    u = torch.ones(2**27, device="tpu") * 2  # 512 MiB, and a peak inside its program
    torch.tpu.synchronize()
    assert torch.tpu.max_memory_allocated() >= before + GiB // 2
    del u


@pytest.mark.parametrize("mode", ["strict", "fused"], indirect=True)
def test_chip_out_of_memory_is_torch_oom_and_the_process_keeps_working(mode):
    _chip()
    keep = torch.arange(1000.0, device="tpu") * 2
    torch.tpu.synchronize()
    ooms = torch.tpu.memory_stats()["num_ooms"]
    big = torch.empty(20 * GiB, dtype=torch.uint8, device="tpu")  # no memory until written
    with pytest.raises(torch.OutOfMemoryError) as info:
        big.fill_(1)
        torch.tpu.synchronize()
    text = str(info.value)
    assert text.startswith("tpu out of memory: ") and "limit=" in text and "To fit:" in text, text
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    with pytest.raises(torch.OutOfMemoryError):
        ones = torch.ones(20 * GiB, dtype=torch.uint8, device="tpu")  # kept: Fused must materialise it
        torch.tpu.synchronize()
    del big
    assert torch.equal(keep.cpu(), torch.arange(1000.0) * 2)
    assert torch.equal((torch.ones(1000, device="tpu") + 1).cpu(), torch.full((1000,), 2.0))
    t = torch.ones(2**28, device="tpu")  # 1 GiB still fits
    assert t.sum().item() == 2**28


@pytest.mark.parametrize("mode", ["strict", "fused"], indirect=True)
def test_clear_kernel_cache_drops_the_compiled_and_keeps_the_tensors(mode):
    """``torch.tpu.clear_kernel_cache()`` empties the kernels and Fused programs (pending Fused work runs
    first); tensors made before keep their values, and the same ops compile again and equal CPU's."""
    x_cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = x_cpu.to("tpu")
    pending = (x * 2 + 1).sum(0)  # Fused: still recorded when the cache goes
    torch.tpu.synchronize()
    assert _core._KERNELS or _fused._PROGRAMS, "nothing compiled: nothing to test"  # noqa: SLF001
    torch.tpu.clear_kernel_cache()
    assert not _core._KERNELS and not _fused._PROGRAMS and _fused.pending_ops() == 0  # noqa: SLF001
    before = torch.tpu.cache_stats()["misses"] + torch.tpu.cache_stats()["programs"]
    again = (x * 2 + 1).sum(0)
    assert torch.equal(pending.cpu(), (x_cpu * 2 + 1).sum(0)) and torch.equal(again.cpu(), pending.cpu())
    assert torch.tpu.cache_stats()["misses"] + torch.tpu.cache_stats()["programs"] > before  # compiled again
