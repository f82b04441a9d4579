"""The ``torch_dynamo_backends`` entry points: ``backend="tpu"`` and ``backend="tpudist"``.

Dynamo loads an entry point's object only when a ``torch.compile`` call names it, so importing
this module costs nothing on ``import torch``. If another installed package also declares a "tpu"
Dynamo backend (TorchTPU does), "tpu" stays theirs and we warn: tpudist's backend is then
``backend="tpudist"``, the same policy as the c10d backend name.
"""

from __future__ import annotations

import warnings

BACKEND_NAME = "tpu"
ALIAS_NAME = "tpudist"
_GROUP = "torch_dynamo_backends"


def _ours(entry_point) -> bool:
    return entry_point.value.split(":")[0].startswith("tpudist.")


def _tpudist_backend(gm, example_inputs, **kwargs):
    from tpudist.compile.backend import backend

    return backend(gm, example_inputs, **kwargs)


def _choose_tpu():
    """tpudist's backend, unless another package registered "tpu" too: then theirs, with a warning."""
    from importlib.metadata import entry_points

    others = [ep for ep in entry_points(group=_GROUP) if ep.name == BACKEND_NAME and not _ours(ep)]
    if not others:
        return _tpudist_backend
    warnings.warn(f'Dynamo backend "{BACKEND_NAME}" is also registered by {others[0].value}; tpudist keeps '
                  f'theirs. Use torch.compile(..., backend="{ALIAS_NAME}") for tpudist\'s backend.', stacklevel=2)
    return others[0].load()


tpudist = _tpudist_backend
tpu = _choose_tpu()
