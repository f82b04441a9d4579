"""tpudist's version, in a module of its own so that modules inside the package read it without
importing the package face (``tpudist/__init__.py``). pyproject.toml names the same version."""

__version__ = "0.1.0"
