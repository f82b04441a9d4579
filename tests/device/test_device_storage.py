"""A tpu tensor's untyped storage against a CPU tensor's: its size in bytes, its address, ``copy_`` to and from
host storages, ``resize_``, ``Tensor.set_(storage)`` and DCP's staging of tensors by their storages.

A tpu storage's values are a ``jax.Array`` held by the storage's Python object; with the device's C++ hooks the
storage reports the bytes that array holds (``nbytes()``, ``size()``), has an address of its own (never read),
and ``UntypedStorage.resize_`` frees or re-sizes the array (FSDP2's ``free_storage``/``alloc_storage``).
``dcp.async_save`` stages tensors by ``UntypedStorage.copy_`` into host storages; across 2 ranks it is
checked in test_device_dist_2.py.
"""

from __future__ import annotations

import pytest
import torch

import tpudist.device  # noqa: F401

pytestmark = pytest.mark.skipif(not tpudist.device._hooks.active(),  # noqa: SLF001
                                reason="tpu storage sizes need the device's C++ hooks (test_device_cpp_hooks.py)")

MODES = pytest.mark.parametrize("mode", ["strict", "fused"], indirect=True)
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


def _host(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    if dtype.is_complex:
        return torch.complex(torch.arange(n, dtype=torch.float32), -torch.arange(n, dtype=torch.float32))
    return (torch.arange(n) * 3 - 5).to(dtype)


def _as(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.Tensor:
    """A host storage's bytes as a flat tensor of ``dtype``."""
    return torch.empty(0, dtype=dtype).set_(storage, 0, (storage.nbytes() // dtype.itemsize,), (1,))


@MODES
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_storage_reports_the_bytes_a_cpu_storage_of_its_tensor_holds(mode, dtype):
    host = _host(dtype)
    x = host.to("tpu")
    assert x.untyped_storage().nbytes() == host.untyped_storage().nbytes() == x.untyped_storage().size()
    assert x[2:].untyped_storage().nbytes() == host.untyped_storage().nbytes()  # a view: its base's storage
    made = torch.zeros(3, 5, device="tpu", dtype=dtype)  # a factory, and an op's result (the fast path's)
    assert made.untyped_storage().nbytes() == 15 * dtype.itemsize
    assert (x == x).untyped_storage().nbytes() == 6


@MODES
def test_storage_addresses_are_distinct_and_views_are_offsets_into_them(mode):
    a, b = torch.ones(8, device="tpu"), torch.ones(8, device="tpu")
    assert a.data_ptr() != 0 and a.data_ptr() != b.data_ptr()
    assert a[3:].data_ptr() == a.data_ptr() + 3 * 4  # as on CPU: the base's address plus the offset's bytes
    assert a.view(2, 4).t().data_ptr() == a.data_ptr()


@MODES
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_untyped_storage_copy_to_and_from_host_storages_equals_cpu(mode, dtype):
    host = _host(dtype)
    x = host.to("tpu")
    staged = torch.UntypedStorage(x.untyped_storage().nbytes()).copy_(x.untyped_storage())
    assert torch.equal(_as(staged, torch.uint8), _as(host.untyped_storage(), torch.uint8))
    other = _host(dtype, 6).flip(0).contiguous()
    view = x[1:4]
    x.untyped_storage().copy_(other.untyped_storage())  # host -> device, all bytes
    assert torch.equal(x.cpu(), other) and torch.equal(view.cpu(), other[1:4])
    with pytest.raises(RuntimeError, match="size does not match"):
        torch.UntypedStorage(3).copy_(x.untyped_storage())


@MODES
def test_set_of_a_tpu_storage_gives_a_tensor_over_it(mode):
    x = torch.arange(12.0, device="tpu")
    y = torch.empty(0, device="tpu").set_(x.untyped_storage(), 2, (3, 2), (1, 3))
    ref = torch.empty(0).set_(torch.arange(12.0).untyped_storage(), 2, (3, 2), (1, 3))
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert (y.shape, y.stride(), y.storage_offset()) == (ref.shape, ref.stride(), ref.storage_offset())
    assert torch.equal(y.cpu(), ref)
    y.mul_(-1)  # a write through it reaches x
    assert x.cpu()[2:8].tolist() == [-2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    whole = torch.empty(0, device="tpu", dtype=torch.int32).set_(x.untyped_storage())  # reinterpreted, as on CPU
    assert torch.equal(whole.cpu(), torch.empty(0, dtype=torch.int32).set_(x.cpu().untyped_storage()))
    with pytest.raises(RuntimeError, match="needs 52 bytes of its storage, which holds 48"):
        torch.empty(0, device="tpu").set_(x.untyped_storage(), 1, (12,), (1,))


@MODES
def test_resize_keeps_the_leading_elements_and_zero_frees_the_array(mode):
    host = torch.arange(1 << 16, dtype=torch.float32)
    x = (host.to("tpu") * 2)  # in Fused mode, a value the pending graph computes
    storage = x.untyped_storage()
    storage.resize_(16)
    assert storage.nbytes() == 16
    assert torch.equal(torch.empty(0, device="tpu").set_(storage).cpu(), host[:4] * 2)
    storage.resize_(32)  # grown: the leading elements stay, the rest reads as zeros
    assert torch.equal(torch.empty(0, device="tpu").set_(storage).cpu(), torch.cat([host[:4] * 2, torch.zeros(4)]))
    big = torch.ones(1 << 18, device="tpu")
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    big.untyped_storage().resize_(0)  # what FSDP2's free_storage does after forward
    assert big.untyped_storage().nbytes() == 0
    assert before - torch.tpu.memory_allocated() >= 4 << 18
    big.untyped_storage().resize_(4 << 18)  # alloc_storage: the all-gather writes it before anything reads it
    assert torch.equal(big.cpu(), torch.zeros(1 << 18))
    with pytest.raises(RuntimeError, match=r"resize_\(6\) of a tpu storage of torch.float32: .* multiple of the "
                                           r"element size, 4"):
        big.untyped_storage().resize_(6)


@MODES
def test_dcp_staging_copies_device_tensors_to_the_host_by_their_storages(mode):
    """``StateDictStager`` is what ``dcp.async_save`` stages a state dict with (torch 2.13)."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    base = torch.arange(24.0).reshape(4, 6)
    x = base.to("tpu")
    state = {"w": x, "t": x.t(), "row": x[2], "bf16": base.to(torch.bfloat16).to("tpu"), "step": torch.tensor(3)}
    staged = StateDictStager().stage(state)
    ref = {"w": base, "t": base.t(), "row": base[2], "bf16": base.to(torch.bfloat16), "step": torch.tensor(3)}
    for name, value in ref.items():
        assert staged[name].device.type == "cpu", name
        assert staged[name].dtype == value.dtype and torch.equal(staged[name], value), name
        assert staged[name].stride() == value.stride(), name
    assert staged["w"].untyped_storage().data_ptr() == staged["t"].untyped_storage().data_ptr()  # still shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_reads_are_row_major_whatever_the_arrays_layout(dtype):
    """On a TPU, XLA picks an N-d result's layout and np.asarray keeps its dim order in the strides (a
    (3, 5, 8) float32 array as major_to_minor (1, 0, 2): strides (8, 24, 1)); a value read to the host
    is row-major all the same. The chip's layout given to a CPU array."""
    import jax
    import numpy as np
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    from tpudist.device import _storage
    from tpudist.ops import to_jax_dtype
    from tpudist import bridge

    chip_layout = Format(Layout(major_to_minor=(1, 0, 2)), SingleDeviceSharding(jax.devices("cpu")[0]))
    want = torch.arange(120, dtype=torch.float32).reshape(3, 5, 8).to(dtype)
    array = jax.jit(lambda a: a.astype(to_jax_dtype(dtype)) * 1, out_shardings=chip_layout)(
        np.arange(120, dtype=np.float32).reshape(3, 5, 8))
    assert not np.asarray(array).flags.c_contiguous  # as on the chip
    got = _storage.to_torch(array)
    assert got.stride() == (40, 8, 1) and torch.equal(got, want)
    view = bridge.torch_view(array)  # kernels' and DTensors' results: row-major too
    assert view.is_contiguous() and torch.equal(view, want)
