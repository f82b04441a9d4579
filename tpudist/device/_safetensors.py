"""safetensors files opened onto the "tpu" device.

safetensors' ``safe_open`` (Rust, 0.8) knows a fixed list of devices and refuses every other one
("device tpu is invalid"), so ``safetensors.torch.load_file(f, device="tpu")``, ``load_model(...,
device="tpu")`` and the libraries that pass a device through (peft's ``PeftModel.from_pretrained`` onto a
tpu model, diffusers' ``load_state_dict``) failed. Once safetensors is imported, its ``safe_open`` (the
package's name, and the one bound in every module that imported it by name before) opens a file for
"tpu", "tpu:N" or ``torch.device("tpu", N)`` on the host and moves each tensor it returns to that device;
every other device and framework goes to safetensors unchanged. The host tensors are views of the
file's mapping: each is dropped once moved, so a loaded model keeps no host copy.
"""

from __future__ import annotations

import sys

import torch

from tpudist._after_import import when_imported

_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")  # what safetensors takes as framework= for torch


def _tpu_device(device) -> torch.device | None:
    """``device`` as a torch.device when it names the "tpu" device, else None (safetensors' to judge)."""
    if isinstance(device, torch.device):
        return device if device.type == "tpu" else None
    if isinstance(device, str) and device.split(":", 1)[0] == "tpu":
        return torch.device(device)  # "tpu:x" raises torch's own error, naming the string
    return None


class _OnDevice:
    """A file ``safe_open`` opened on the host, whose tensors come out on ``device``."""

    def __init__(self, opened, device: torch.device) -> None:
        self._opened, self._device = opened, device

    def __enter__(self):
        self._opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self._opened.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._opened.get_tensor(name).to(self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self._opened.keys()}

    def get_slice(self, name: str):
        return _SliceOnDevice(self._opened.get_slice(name), self._device)

    def __getattr__(self, name: str):  # keys, metadata, offset_keys, ...: as the host file says
        return getattr(self._opened, name)


class _SliceOnDevice:
    """``get_slice``'s lazy slice, whose indexed parts come out on ``device``."""

    def __init__(self, piece, device: torch.device) -> None:
        self._piece, self._device = piece, device

    def __getitem__(self, index) -> torch.Tensor:
        return self._piece[index].to(self._device)

    def __getattr__(self, name: str):  # get_shape, get_dtype
        return getattr(self._piece, name)


def _wrap(original):
    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        target = _tpu_device(device) if framework in _TORCH_FRAMEWORKS else None
        if target is None:
            return original(filename, framework, device, *args, **kwargs)
        return _OnDevice(original(filename, framework, "cpu", *args, **kwargs), target)

    safe_open.__doc__ = original.__doc__
    safe_open.__wrapped__ = original
    safe_open.tpudist = True
    return safe_open


def _patch(package) -> None:
    original = package.safe_open
    if getattr(original, "tpudist", False):
        return
    wrapped = _wrap(original)
    # modules that imported the name before this ran hold the original (safetensors.torch's load_file
    # looks it up in its own module at each call; peft, accelerate, transformers bind it at import)
    # A module's own namespace only: getattr would run a lazy module's __getattr__ (transformers' does an
    # import there), and this runs while safetensors is being imported, inside someone else's import.
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("safe_open") is original:
            module.safe_open = wrapped


def register() -> None:
    """Wraps safetensors' ``safe_open`` now if safetensors is imported, else right after its import."""
    when_imported("safetensors", _patch)
