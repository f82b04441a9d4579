"""The ``torch.backends`` entry point: registers the "tpu" c10d backend name, nothing more.

PyTorch calls :func:`register` on every ``import torch``, so it must stay cheap: it imports neither
JAX nor the rest of tpudist. JAX is loaded when the first "tpu" process group is created.
"""

from __future__ import annotations

import warnings

BACKEND_NAME = "tpu"
ALIAS_NAME = "tpudist"  # always ours, for when another package already owns "tpu"


def _create(dist_backend_opts, backend_options):
    from tpudist.process_group.group import create_process_group

    return create_process_group(dist_backend_opts, backend_options)


_create.tpudist = True  # marks our creator, so a second register() recognises it


def _plugin(name: str):
    import torch.distributed as dist

    return dist.Backend._plugins.get(name.upper())  # noqa: SLF001 - torch keeps no public map


def _is_ours(plugin) -> bool:
    return getattr(plugin.creator_fn, "tpudist", False)


def our_backend_name() -> str:
    """The c10d name of tpudist's backend in this process: "tpu", or "tpudist" when another package owns "tpu"."""
    plugin = _plugin(BACKEND_NAME)
    return BACKEND_NAME if plugin is not None and _is_ours(plugin) else ALIAS_NAME


def register() -> None:
    """Registers "tpu" (unless another package owns it) and the alias "tpudist"."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in (BACKEND_NAME, ALIAS_NAME):
        existing = _plugin(name)
        if existing is not None and not _is_ours(existing):
            warnings.warn(
                f'c10d backend "{name}" is already registered by another package; tpudist keeps '
                f'theirs. Use init_process_group("{ALIAS_NAME}") for tpudist.', stacklevel=2)
            continue
        if existing is None:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["cpu"])
