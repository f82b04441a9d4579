"""The tpu device's C++ PrivateUse1 hooks (tpudist/device/_hooks.py, csrc/hooks.cpp): torch's pinned host
memory paths work, the hooks answer what torch's Python hooks answered, the build happens once per user
(also under concurrent first imports), and without them (``TPUDIST_CPP_HOOKS=0``, no compiler) the device
still works on the Python hooks, with one warning naming what does not.

DDP's ``find_unused_parameters``/``static_graph`` on the device (the reason for the hooks) are compared with
gloo in test_device_dist_2.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tpudist.device import _hooks


def _fresh_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def test_cpp_hooks_are_torchs_privateuse1_hooks():
    assert _hooks.active()
    # torch keeps the first hooks object: a Python one registered later is refused
    assert torch._C._acc.register_python_privateuseone_hook(torch._C._acc.PrivateUse1Hooks()) is False  # noqa: SLF001
    assert _hooks.active()


def test_pin_memory_true_allocates_host_memory_torch_sees_as_pinned():
    before = _hooks.pinned_bytes()
    x = torch.empty(3, pin_memory=True)
    assert x.is_pinned() and x.device.type == "cpu"
    assert _hooks.pinned_bytes() - before >= 12  # the allocator's blocks, page-aligned by c10::alloc_cpu
    block = torch.arange(10.0).pin_memory()
    assert block[3:].is_pinned() and block[3:].storage_offset() == 3  # an address inside a pinned block
    assert not torch.arange(10.0).is_pinned()
    like = torch.empty_like(torch.ones(2, 3), pin_memory=True)  # what DDP's reducer allocates
    assert like.is_pinned()
    on_device = block.to("tpu", non_blocking=True)
    assert torch.equal(on_device.cpu(), torch.arange(10.0))
    del x, block, like
    assert _hooks.pinned_bytes() == before  # freed blocks leave the allocator's table
    assert not torch.empty(0, pin_memory=True).is_pinned()  # nothing allocated: nothing pinned, as on CPU


def test_tensor_pin_memory_keeps_strides_and_refuses_another_device():
    plain = torch.randn(2, 5)
    pinned = plain.t().pin_memory()
    assert pinned.is_pinned() and pinned.stride() == plain.t().stride() and torch.equal(pinned, plain.t())
    assert pinned.pin_memory() is pinned
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pinned for 'tpu' only"):
        plain.pin_memory("cuda")


def test_bad_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TPUDIST_CPP_HOOKS", "yes")
    with pytest.raises(ValueError, match="TPUDIST_CPP_HOOKS='yes' must be '1'"):
        _hooks.enabled()


_PROBE = """
import warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch, tpudist.device
from tpudist.device import _hooks
warnings.simplefilter("ignore")

def ask(fn):
    try:
        return repr(fn())
    except Exception as e:
        return type(e).__name__

answers = {
    "warnings": [str(w.message) for w in seen if issubclass(w.category, _hooks.CppHooksWarning)],
    "active": _hooks.active(),
    "accelerator": ask(torch.accelerator.current_accelerator),
    "available": ask(torch.accelerator.is_available),
    "count": ask(torch.accelerator.device_count),
    "index": ask(torch.accelerator.current_device_index),
    "hooks_count": ask(torch._C._accelerator_hooks_device_count),
    "generator": ask(lambda: torch.Generator("tpu").device),
    "device_is_pinned": ask(lambda: torch.ones(2, device="tpu").is_pinned()),
    "sum": ask(lambda: (torch.ones(2, device="tpu") * 3).sum().item()),
    "backward": ask(lambda: torch.ones(2, device="tpu", requires_grad=True).mul(2).sum().backward()),
    "resize": ask(lambda: torch.ones(2, device="tpu").untyped_storage().resize_(0).nbytes()),
    "nbytes": ask(lambda: torch.ones(2, device="tpu").untyped_storage().nbytes()),
    "pin_memory": ask(lambda: torch.randn(3).pin_memory().is_pinned()),
    "empty_pinned": ask(lambda: torch.empty(3, pin_memory=True).is_pinned()),
    "synchronize": ask(torch.accelerator.synchronize),
    "stream": ask(torch.accelerator.current_stream),
}
print(answers)
"""


@pytest.fixture(scope="module")
def probed() -> dict:
    """What torch answers in a fresh process with the C++ hooks ("1") and with the Python ones ("0")."""
    got = {}
    for value in ("1", "0"):
        result = _fresh_python(_PROBE, {"TPUDIST_CPP_HOOKS": value})
        assert result.returncode == 0, result.stderr
        got[value] = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's dict
    return got


# what the two hooks answer differently, by design
_DIFFERENT = ("warnings", "active", "empty_pinned", "generator", "resize", "nbytes")


def test_cpp_hooks_answer_what_the_python_hooks_answered(probed):
    """Everything torch asks the hooks, through its public API, is the same on both; only what needs a
    pinned allocator in C++ differs."""
    cpp, python = probed["1"], probed["0"]
    assert {k: v for k, v in cpp.items() if k not in _DIFFERENT} == {k: v for k, v in python.items()
                                                                     if k not in _DIFFERENT}
    assert (cpp["warnings"], cpp["active"], cpp["empty_pinned"]) == ([], True, "True")
    assert cpp["generator"] == "device(type='tpu', index=0)"  # getNewGenerator (test_device_generator.py)
    assert (cpp["nbytes"], cpp["resize"]) == ("8", "0")  # storage sizes (test_device_storage.py)
    assert cpp["accelerator"] == "device(type='tpu')" and cpp["sum"] == "6.0" and cpp["pin_memory"] == "True"


def _check_warning(messages: list, reason: str) -> None:
    assert len(messages) == 1, messages
    for named in (reason, "find_unused_parameters=True", "static_graph=True", "pin_memory=True",
                  "torch.Generator(device='tpu')", "install g++"):
        assert named in messages[0], (named, messages[0])


def test_fallback_with_env_zero_warns_once_and_the_device_works(probed):
    python = probed["0"]
    _check_warning(python["warnings"], "TPUDIST_CPP_HOOKS=0")
    assert python["active"] is False
    assert python["empty_pinned"] == "NotImplementedError"  # torch's own error, as before the C++ hooks
    assert python["generator"] == "NotImplementedError"  # torch's ("implement getNewGenerator"); the warning says it
    assert (python["nbytes"], python["resize"]) == ("0", "NotImplementedError")  # FSDP2 then goes through device/_fsdp.py
    assert python["pin_memory"] == "True" and python["sum"] == "6.0"  # device/_pinned.py; the device works


def test_fallback_without_a_compiler_names_the_missing_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUDIST_CPP_HOOKS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-h29")
    with pytest.warns(_hooks.CppHooksWarning) as seen:
        assert _hooks.install() is False
    _check_warning([str(w.message) for w in seen], "'no-such-compiler-h29' is not on PATH")
    assert not any(tmp_path.iterdir())  # nothing half-built
    assert _hooks.active()  # this process's hooks, registered at import, are untouched


_FIRST_IMPORT = """
import tpudist.device
from tpudist.device import _hooks
print(_hooks.active(), _hooks.built_here)
"""


def test_concurrent_first_imports_build_once_and_later_imports_only_load(tmp_path):
    """Two processes import tpudist.device at once into an empty build folder: one compiles, the other
    waits on the lock and loads the same library; a third import only loads it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TPUDIST_CPP_HOOKS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_IMPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err
            outs.append(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(outs) == ["True False", "True True"], outs
    later = _fresh_python(_FIRST_IMPORT, {"TPUDIST_CPP_HOOKS_DIR": str(tmp_path)})
    assert later.returncode == 0, later.stderr
    assert later.stdout.strip().splitlines()[-1] == "True False"
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / "ready").is_file(), list(tmp_path.iterdir())
