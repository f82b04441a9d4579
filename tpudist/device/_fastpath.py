"""The per-op signature in C++ (``csrc/fastpath.cpp``), or None where it cannot be used.

``_core._signature`` is the hot path of every op on the device (issue #28). The C++ module returns
exactly the key of the Python version (``_core._signature_py``), which stays the reference and the
fallback: the C++ code hands it any call it does not handle itself (tensor subclasses other than
Parameter, unusual argument containers). tests/device/test_device_fastpath.py compares the two.

Built like the C++ hooks (``_hooks.build``: once per user and source, under a file lock) into
``$TPUDIST_CPP_FASTPATH_DIR`` (default ``$XDG_CACHE_HOME/tpudist/cpp_fastpath``). ``TPUDIST_CPP_FASTPATH=0``
keeps the Python signature; so do a missing compiler (silently: the hooks' warning already says so)
and a failed build (with a warning: that is a bug).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import warnings
from pathlib import Path

from tpudist._switches import switch

_NAME = "tpudist_fastpath"
_SOURCE = Path(__file__).with_name("csrc") / "fastpath.cpp"

reason = ""  # why the C++ signature is not in use ("" when it is)


def enabled() -> bool:
    """Whether ``TPUDIST_CPP_FASTPATH`` allows the C++ signature (unset or "1"; "0" keeps the Python one)."""
    return switch("TPUDIST_CPP_FASTPATH", "1", "build and use the C++ per-op signature, the default",
                  "the Python one: same keys, more host time per op")


def root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.environ.get("TPUDIST_CPP_FASTPATH_DIR") or str(Path(base) / "tpudist" / "cpp_fastpath")


def build() -> Path:
    """The built module's path (built now unless a process built it before); raises a failed build's error."""
    from tpudist.device import _hooks

    return _hooks.build(_SOURCE, _NAME, root())


def load():
    """The C++ module, or None (``reason`` says why)."""
    global reason
    if not enabled():
        reason = "TPUDIST_CPP_FASTPATH=0"
        return None
    from tpudist.device import _hooks

    missing = _hooks.missing_tool()
    if missing is not None:
        reason = missing
        return None
    try:
        path = build()
        spec = importlib.util.spec_from_file_location(
            _NAME, path, loader=importlib.machinery.ExtensionFileLoader(_NAME, str(path)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failed build or load: the Python signature, and say so
        reason = _hooks.build_failure(_SOURCE, e)
        warnings.warn(f"tpudist.device uses its Python per-op signature ({reason}); ops cost more host time. "
                      "Set TPUDIST_CPP_FASTPATH=0 to silence this.", RuntimeWarning, stacklevel=3)
        return None
    return module
