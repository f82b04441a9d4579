"""Route plain ``@helion.kernel`` calls on "tpu" tensors through tpudist once Helion is imported.

The package face (``tpudist/__init__.py``) calls :func:`route_helion_with_the_device` on import: when
``tpudist.device`` (the opt-in) has been imported, the route waits for Helion. Importing Helion costs
seconds (it loads scikit-learn), so nothing here imports it: the route (``tpudist.kernels.helion``)
is installed then if Helion is imported, else right after ``import helion`` finishes
(:func:`tpudist._after_import.when_imported`). The device never imports this module: it is a layer
below the kernels.
"""

from __future__ import annotations

from tpudist._after_import import when_imported


def _route(_helion) -> None:
    import tpudist.kernels.helion  # noqa: F401  (installs the route on import)


def route_helion_when_imported() -> None:
    """Installs ``tpudist.kernels.helion``'s route now if Helion is imported, else when it is."""
    when_imported("helion", _route)


def _on_the_device(_device) -> None:
    route_helion_when_imported()


def route_helion_with_the_device() -> None:
    """Once ``tpudist.device`` is imported (its install done), routes Helion's calls as
    :func:`route_helion_when_imported` does; a process that never imports the device is left alone."""
    when_imported("tpudist.device", _on_the_device)


__all__ = ["route_helion_when_imported", "route_helion_with_the_device"]
