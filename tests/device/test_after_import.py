"""``tpudist._after_import.when_imported``: how the device hooks into accelerate, and the package face
into the device and Helion, without importing them. The callback runs once, after the module's body, for a package and a submodule, and at
once for a module imported already."""

from __future__ import annotations

import importlib
import sys

from tpudist._after_import import _AfterImport, when_imported


def test_callback_runs_after_the_import_finishes_and_once(tmp_path, monkeypatch):
    pkg = tmp_path / "tpudist_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("tpudist_probe_pkg.sub", lambda m: seen.append(("sub", m.READY)))
    when_imported("tpudist_probe_pkg", lambda m: seen.append(("pkg", m.VALUE)))
    try:
        assert seen == []
        importlib.import_module("tpudist_probe_pkg.sub")
        assert seen == [("pkg", 1), ("sub", True)]  # each after its module's body ran
        assert not _probe_finders()  # one shot
        importlib.reload(sys.modules["tpudist_probe_pkg.sub"])
        assert len(seen) == 2
        when_imported("tpudist_probe_pkg.sub", lambda m: seen.append(("now", m.READY)))  # imported: at once
        assert seen[-1] == ("now", True)
    finally:
        for name in ("tpudist_probe_pkg.sub", "tpudist_probe_pkg"):
            sys.modules.pop(name, None)
        for finder in _probe_finders():
            sys.meta_path.remove(finder)


def _probe_finders() -> list:
    return [f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name.startswith("tpudist_probe_pkg")]


def test_a_lookup_that_does_not_import_leaves_the_callback_for_the_import(tmp_path, monkeypatch):
    """A test's skip condition (``importlib.util.find_spec``) asks the finders without importing: the
    import after it must still call back (safetensors' hook missed it, and load_file(device="tpu") failed)."""
    import importlib.util

    (tmp_path / "tpudist_probe_mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("tpudist_probe_mod", lambda m: seen.append(m.VALUE))
    try:
        assert importlib.util.find_spec("tpudist_probe_mod") is not None
        assert seen == [] and "tpudist_probe_mod" not in sys.modules
        importlib.import_module("tpudist_probe_mod")
        assert seen == [7]
        assert not [f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == "tpudist_probe_mod"]
    finally:
        sys.modules.pop("tpudist_probe_mod", None)
        for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == "tpudist_probe_mod"]:
            sys.meta_path.remove(finder)
