"""Route plain ``@helion.kernel`` calls on "tpu" tensors through tpudist once Helion is imported.

The "tpu" device calls :func:`route_helion_when_imported` at install. Importing Helion costs seconds
(it loads scikit-learn), so nothing here imports it: if Helion is already imported the route
(``tpudist.kernels.helion``) is installed now, else right after ``import helion`` finishes, through
a one-shot ``sys.meta_path`` finder that wraps Helion's loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def route_helion_when_imported() -> None:
    """Installs ``tpudist.kernels.helion``'s route now if Helion is imported, else when it is."""
    if "helion" in sys.modules:
        import tpudist.kernels.helion  # noqa: F401

        return
    if not any(isinstance(f, _AfterHelionImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterHelionImport())


class _AfterHelionImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "helion":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding this finder
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_helion = spec.loader.exec_module

        def exec_then_route(module):
            exec_helion(module)
            import tpudist.kernels.helion  # noqa: F401  (Helion is complete here: its __init__ ran)

        spec.loader.exec_module = exec_then_route
        return spec


__all__ = ["route_helion_when_imported"]
