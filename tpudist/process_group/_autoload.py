"""The ``torch.backends`` entry point: registers the "tpu" c10d backend name, nothing more.

PyTorch calls :func:`register` on every ``import torch``, so it must stay cheap: it imports neither
JAX nor the rest of tpudist. JAX is loaded when the first "tpu" process group is created.
"""

from __future__ import annotations

import warnings

from tpudist._backend_names import ALIAS_NAME, BACKEND_NAME, is_ours, our_backend_name, plugin  # noqa: F401 - our_backend_name: also here


def _create(dist_backend_opts, backend_options):
    from tpudist.process_group.group import create_process_group

    return create_process_group(dist_backend_opts, backend_options)


_create.tpudist = True  # marks our creator, so a second register() recognises it


def register() -> None:
    """Registers "tpu" (unless another package owns it) and the alias "tpudist"."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in (BACKEND_NAME, ALIAS_NAME):
        existing = plugin(name)
        if existing is not None and not is_ours(existing):
            warnings.warn(
                f'c10d backend "{name}" is already registered by another package; tpudist keeps '
                f'theirs. Use init_process_group("{ALIAS_NAME}") for tpudist.', stacklevel=2)
            continue
        if existing is None:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["cpu"])
