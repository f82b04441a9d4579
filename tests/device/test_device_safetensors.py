"""safetensors files loaded onto the "tpu" device, against the same files loaded on the CPU.

safetensors' own ``safe_open`` refuses every device it does not know ("device tpu is invalid"); the device
wraps it (tpudist/device/_safetensors.py). Values must equal CPU's bit for bit (a load is a copy), the
results must live on the device with no view of the file's mapping left (the file is overwritten under
them), and every other device keeps safetensors' own behaviour and errors.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                reason="safetensors is not installed (pip install -e '.[test]' brings it)")

DEVICES = ["tpu", "tpu:0", torch.device("tpu", 0), torch.device("tpu")]

# every dtype safetensors stores that the device holds, with values that show a bit wrongly copied
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(_DTYPES):
        shape = (3, 5 + i)  # uneven, distinct per tensor
        if dtype.is_floating_point or dtype.is_complex:
            value = torch.randn(shape, generator=g, dtype=dtype if dtype.is_complex else torch.float64).to(dtype)
        elif dtype == torch.bool:
            value = torch.randint(0, 2, shape, generator=g).bool()
        else:
            info = torch.iinfo(dtype)
            value = torch.randint(max(info.min, -2**62), min(info.max, 2**62), shape, generator=g, dtype=torch.int64)
            value = value.to(dtype)
        out[f"t_{str(dtype).removeprefix('torch.')}"] = value
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4)
    return out


@pytest.fixture
def saved(tmp_path):
    from safetensors.torch import save_file

    tensors = _tensors()
    path = str(tmp_path / "weights.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def _overwrite(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """The file replaced by zeros of the same layout: a result still reading the old mapping would change."""
    from safetensors.torch import save_file

    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, path)


def _assert_on_device_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], device) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].device == torch.device("tpu", 0), (name, device, got[name].device)
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].cpu(), value), name


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_load_file_onto_the_device(saved, device):
    from safetensors.torch import load_file

    path, want = saved
    got = load_file(path, device=device)
    _overwrite(path, want)
    _assert_on_device_equal(got, want, device)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_safe_open_onto_the_device(saved, device):
    from safetensors import safe_open

    path, want = saved
    with safe_open(path, framework="pt", device=device) as f:
        assert sorted(f.keys()) == sorted(want)
        assert f.metadata() == {"format": "pt"}
        got = {name: f.get_tensor(name) for name in f.keys()}
        piece = f.get_slice("t_float32")
        assert piece.get_shape() == [3, 5]
        part = piece[1:, 2:4]
        everything = f.get_tensors()
    _overwrite(path, want)
    _assert_on_device_equal(got, want, device)
    _assert_on_device_equal(everything, want, device)
    assert part.device.type == "tpu" and torch.equal(part.cpu(), want["t_float32"][1:, 2:4])


def test_load_model_and_save_model_on_the_device(tmp_path):
    from safetensors.torch import load_model, save_model

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    path = str(tmp_path / "model.safetensors")
    save_model(source.to("tpu"), path)  # a tpu model saved: its tensors read back through the host
    target = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4)).to("tpu")
    missing, unexpected = load_model(target, path, device="tpu")
    assert (missing, unexpected) == (set(), [])
    for (name, got), want in zip(target.state_dict().items(), source.state_dict().values()):
        assert got.device.type == "tpu" and torch.equal(got.cpu(), want.cpu()), name


def test_tensor_address_is_its_storage_address_plus_offset():
    """As on CPU: safetensors' load_model/save_model take a tensor for its whole storage by comparing them."""
    from tpudist.device import _hooks

    if not _hooks.active():
        pytest.skip("without the C++ hooks (TPUDIST_CPP_HOOKS=0) a tpu tensor's data_ptr() is 0")
    x = torch.arange(12.0).to("tpu")
    for t in (x, x[3:], x.view(3, 4)[1]):
        assert t.data_ptr() == t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def test_other_devices_and_frameworks_are_safetensors_own(saved):
    import numpy as np
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path, want = saved
    assert all(v.device.type == "cpu" for v in load_file(path).values())
    assert all(v.device.type == "cpu" for v in load_file(path, device="cpu").values())
    with safe_open(path, framework="np", device="cpu") as f:
        assert isinstance(f.get_tensor("t_float32"), np.ndarray)
    with pytest.raises(SafetensorError, match="device tpux is invalid"):
        load_file(path, device="tpux")
    with pytest.raises(RuntimeError, match="Invalid device string: 'tpu:x'"):
        load_file(path, device="tpu:x")


_FRESH_PROCESS = r"""
import sys, torch
from safetensors import safe_open  # as libraries do, before the device is imported
import safetensors.torch as st
import tpudist.device
st.save_file({"w": torch.arange(6.0).reshape(2, 3)}, sys.argv[1])
with safe_open(sys.argv[1], framework="pt", device="tpu") as f:
    w = f.get_tensor("w")
print(w.device, w.cpu().tolist(), st.load_file(sys.argv[1], device="tpu")["w"].device)
"""


def test_a_name_bound_before_the_device_was_imported(tmp_path):
    """peft, accelerate and transformers bind ``safe_open``/``load_file`` at import, often before tpudist."""
    path = str(tmp_path / "w.safetensors")
    env = {**os.environ, "TPUDIST_EAGER_MODE": "strict"}
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, path], capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "tpu:0 [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] tpu:0", run.stdout


_LAZY_MODULE = """
import sys, types
import tpudist.device  # noqa: F401  before safetensors: the wrap runs inside safetensors' import
class Lazy(types.ModuleType):
    def __getattr__(self, name):  # transformers' lazy module imports its submodules here
        raise RuntimeError(f"lazy module asked for {name}")
sys.modules["some_lazy_package"] = Lazy("some_lazy_package")
import safetensors.torch
print("wrapped", getattr(safetensors.torch.safe_open, "tpudist", False))
"""


def test_the_wrap_does_not_wake_lazy_modules():
    """Rebinding ``safe_open`` in modules that imported it reads each module's own namespace: a lazy
    module's ``__getattr__`` (transformers' imports submodules there) must not run inside safetensors'
    import (on a TPU VM's transformers that raised a circular ImportError from ``LlamaConfig``)."""
    run = subprocess.run([sys.executable, "-c", _LAZY_MODULE], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "wrapped True", run.stdout


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_load_checkpoint_in_model_onto_the_device(tmp_path):
    from accelerate.utils import load_checkpoint_in_model
    from safetensors.torch import save_model

    torch.manual_seed(0)
    source = torch.nn.Linear(5, 3)
    path = str(tmp_path / "model.safetensors")
    save_model(source, path)
    target = torch.nn.Linear(5, 3).to("tpu")
    load_checkpoint_in_model(target, path, device_map={"": "tpu"})
    assert target.weight.device.type == "tpu" and torch.equal(target.weight.cpu(), source.weight.detach())


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers is not installed")
def test_diffusers_load_state_dict_onto_the_device(saved):
    from diffusers.models.model_loading_utils import load_state_dict

    path, want = saved
    got = load_state_dict(path, map_location="tpu")
    _overwrite(path, want)
    _assert_on_device_equal(got, want, "tpu")
