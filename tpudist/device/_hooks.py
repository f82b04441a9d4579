"""The "tpu" device's C++ PrivateUse1 hooks (``csrc/hooks.cpp``): built once per user, then only loaded.

torch keeps the first PrivateUse1 hooks object a process registers. The Python one that
``_setup_privateuseone_for_python_backend`` registers cannot hand torch a pinned host allocator, so
``torch.empty(..., pin_memory=True)`` and DDP's ``find_unused_parameters``/``static_graph`` (its C++
reducer stages the used-parameter map through pinned memory for a PrivateUse1 model) raise. ``install()``
registers the C++ hooks first; the Python one is then refused (torch returns False, no error).

The library is built with ``torch.utils.cpp_extension.load`` (g++ and ninja) into
``$TPUDIST_CPP_HOOKS_DIR`` (default ``$XDG_CACHE_HOME/tpudist/cpp_hooks`` or ``~/.cache/tpudist/cpp_hooks``),
one folder per (torch build, source) key, under a file lock: concurrent first imports build it once,
later imports only ``dlopen`` it. The test suite builds it in ``pytest_configure``, before any worker
or rank process starts. Without a compiler, on a failed build or with ``TPUDIST_CPP_HOOKS=0``, the
Python hooks stay, with one warning saying what does not work (``_pinned.py`` then serves
``Tensor.pin_memory()``/``is_pinned()``).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from tpudist._switches import switch

_NAME = "tpudist_hooks"
_SOURCE = Path(__file__).with_name("csrc") / "hooks.cpp"
_READY = "ready"  # holds the library's path, written once the build succeeded

_lib: ctypes.CDLL | None = None
built_here = False  # whether this process compiled the library (tests: concurrent first imports build once)


class CppHooksWarning(RuntimeWarning):
    """The C++ hooks are not in use: pinned host memory allocated in C++, tpu generators and tpu storage sizes are
    unavailable."""


def enabled() -> bool:
    """Whether ``TPUDIST_CPP_HOOKS`` allows the C++ hooks (unset or "1"; "0" forces the Python ones)."""
    return switch("TPUDIST_CPP_HOOKS", "1", "build and use the C++ hooks, the default",
                  "use torch's Python hooks: no pinned allocations in C++")


def build_dir(source: Path = _SOURCE, root: str | None = None) -> Path:
    """The folder of this torch build's and this source's library (it may not exist yet); ``root`` defaults
    to the hooks' (``_fastpath`` builds another source under its own root)."""
    root = root or os.environ.get("TPUDIST_CPP_HOOKS_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpudist" / "cpp_hooks"
    key = hashlib.sha256()
    for part in (torch.__version__, torch.version.git_version, str(torch._C._GLIBCXX_USE_CXX11_ABI)):  # noqa: SLF001
        key.update(part.encode() + b"\0")
    key.update(source.read_bytes())
    return Path(root).expanduser() / f"torch-{torch.__version__}-{key.hexdigest()[:16]}"


def _built(folder: Path) -> Path | None:
    ready = folder / _READY
    if not ready.is_file():
        return None
    path = Path(ready.read_text().strip())
    return path if path.is_file() else None


def missing_tool() -> str | None:
    """Why ``build`` cannot run here ("'ninja' is not on PATH"), or None: the tools cpp_extension.load runs."""
    for tool in ((os.environ.get("CXX") or "c++").split()[0], "ninja"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not on PATH"
    return None


def build_failure(source: Path, error: Exception) -> str:
    """One line saying why building ``source`` failed: the error's type and the last lines of its message."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"building {source.name} failed: {type(error).__name__}: {' / '.join(lines[-3:])[:400]}"


def build(source: Path = _SOURCE, name: str = _NAME, root: str | None = None) -> Path:
    """The built library's path: built now under the folder's lock unless a process built it before.

    Raises whatever the build raised (no compiler, a compile error)."""
    global built_here
    folder = build_dir(source, root)
    path = _built(folder)
    if path is not None:
        return path
    missing = missing_tool()
    if missing is not None:
        raise RuntimeError(missing)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed builder dies
        path = _built(folder)
        if path is not None:
            return path  # another process built it while this one waited
        folder.mkdir(exist_ok=True)
        # torch's own build baton: a builder killed mid-build leaves it, and load() would wait for it forever
        (folder / "lock").unlink(missing_ok=True)
        from torch.utils import cpp_extension

        built_here = built_here or source == _SOURCE
        path = Path(cpp_extension.load(name, [str(source)], extra_cflags=["-O2"], build_directory=str(folder),
                                       is_python_module=False, verbose=False))
        tmp = folder / f"{_READY}.{os.getpid()}"
        tmp.write_text(str(path))
        os.replace(tmp, folder / _READY)
        return path


def _fallback(reason: str) -> bool:
    warnings.warn(
        f"tpudist.device uses torch's Python PrivateUse1 hooks ({reason}). Without its C++ hooks, pinned host "
        "memory allocated in C++ does not work: DDP(find_unused_parameters=True) and DDP(static_graph=True) on "
        "tpu models, torch.empty(..., pin_memory=True) and torch.Generator(device='tpu') raise (Tensor.pin_memory() "
        "and DataLoader(pin_memory=True) still work; without a tpu generator, seed the device's default stream "
        "with torch.manual_seed); tpu storages report 0 bytes, so dcp.async_save of device tensors raises. Fix: install g++ and ninja (the hooks build once per user into "
        f"{build_dir().parent}) and leave TPUDIST_CPP_HOOKS unset.", CppHooksWarning, stacklevel=4)
    return False


def install() -> bool:
    """Register the C++ hooks (before torch's Python ones); False, with one warning, where they cannot be."""
    global _lib
    if not enabled():
        return _fallback("TPUDIST_CPP_HOOKS=0")
    try:
        path = build()
    except Exception as e:  # noqa: BLE001 - any failed build (no compiler, compile error) means the Python hooks
        return _fallback(build_failure(_SOURCE, e))
    _lib = ctypes.CDLL(str(path))
    _lib.tpudist_pinned_bytes.restype = ctypes.c_int64
    _lib.tpudist_set_storage_bytes.argtypes = (ctypes.c_void_p, ctypes.c_int64)
    _lib.tpudist_set_resize_callback.argtypes = (ctypes.py_object,)
    _lib.tpudist_default_generator.restype = ctypes.py_object
    status = _lib.tpudist_register_hooks()
    if status != 1:
        _lib = None
        return _fallback("another PrivateUse1 hooks object was registered first" if status == 0
                         else "torch refused the C++ hooks")
    return True


def active() -> bool:
    """Whether torch's PrivateUse1 hooks are tpudist's C++ hooks in this process."""
    return _lib is not None and _lib.tpudist_hooks_registered() == 1


def set_storage_bytes(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give a tpu storage its size in bytes (and an address of its own); nothing without the C++ hooks, whose
    storages report 0 bytes."""
    if _lib is not None:
        _lib.tpudist_set_storage_bytes(storage._cdata, nbytes)  # noqa: SLF001


def storage_bytes_address() -> int:
    """The address of the C function behind ``set_storage_bytes`` (the C++ fast path calls it), or 0."""
    if _lib is None:
        return 0
    return ctypes.cast(_lib.tpudist_set_storage_bytes, ctypes.c_void_p).value


def on_resize(resize) -> None:
    """``resize(storage, nbytes)`` runs the buffer's side of ``UntypedStorage.resize_`` of a tpu storage (with the
    C++ hooks; without them torch raises)."""
    if _lib is not None:
        _lib.tpudist_set_resize_callback(resize)


def default_generator() -> torch.Generator | None:
    """The device's default generator (the hooks' ``getDefaultGenerator``), or None without the C++ hooks."""
    return _lib.tpudist_default_generator() if _lib is not None else None


def pinned_bytes() -> int:
    """Bytes of host memory currently allocated by the C++ hooks' pinned allocator (0 without them)."""
    return int(_lib.tpudist_pinned_bytes()) if _lib is not None else 0
