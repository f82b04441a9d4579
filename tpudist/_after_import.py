"""Run tpudist's integration with a third-party module right after that module is imported.

Importing a library to patch it can cost seconds (Helion loads scikit-learn) or change what the user
gets, so nothing here imports one: :func:`when_imported` calls back now if the module is imported
already, else right after its import finishes, through a one-shot ``sys.meta_path`` finder that
wraps the module's loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def when_imported(name: str, callback: Callable[[object], None]) -> None:
    """Calls ``callback(module)`` once module ``name`` (``"pkg"`` or ``"pkg.sub"``) is fully imported."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of module ``name``'s spec; leaves ``sys.meta_path`` once that module has run.

    A lookup that does not import (``importlib.util.find_spec(name)``, as a test's skip condition makes)
    also reaches here: the finder stays until the module really executes, or the import after such a
    probe would go unseen."""

    def __init__(self, name: str, callback: Callable[[object], None]) -> None:
        self.name = name
        self.callback = callback
        self._finding = False  # the find_spec below asks the other finders: keep out of that lookup

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.callback(module)  # the module is complete here: its body ran

        spec.loader.exec_module = exec_then_call
        return spec


__all__ = ["when_imported"]
