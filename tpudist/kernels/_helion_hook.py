"""Route plain ``@helion.kernel`` calls on "tpu" tensors through tpudist once Helion is imported.

The "tpu" device calls :func:`route_helion_when_imported` at install. Importing Helion costs seconds
(it loads scikit-learn), so nothing here imports it: the route (``tpudist.kernels.helion``) is
installed now if Helion is imported, else right after ``import helion`` finishes
(:func:`tpudist._after_import.when_imported`).
"""

from __future__ import annotations

from tpudist._after_import import when_imported


def _route(_helion) -> None:
    import tpudist.kernels.helion  # noqa: F401  (installs the route on import)


def route_helion_when_imported() -> None:
    """Installs ``tpudist.kernels.helion``'s route now if Helion is imported, else when it is."""
    when_imported("helion", _route)


__all__ = ["route_helion_when_imported"]
