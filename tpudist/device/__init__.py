"""The "tpu" PyTorch device: tensors that live in JAX arrays, run as XLA in Debug, Strict or Fused mode.

    import torch, tpudist.device               # the one opt-in line
    torch.tpu.set_eager_mode("fused")           # "debug" | "strict" | "fused"; env TPUDIST_EAGER_MODE
    model = Transformer(cfg).to("tpu")
    loss = model(x).logsumexp(-1).mean(); loss.backward(); opt.step()
    print(loss.item())                          # a sync point: in Fused mode the step runs here

Importing this module renames torch's PrivateUse1 backend to "tpu" (for the whole process:
``torch.accelerator`` then reports "tpu"), registers the kernels and the ``torch.tpu`` module. Nothing
else installs it, and nothing here starts a JAX backend: the device is looked up on first use (in a
"tpu" process-group world, after ``init_process_group("tpu")`` booted JAX's distributed runtime).

Modes (``torch.tpu.set_eager_mode``; default "strict"):
- "debug": every op runs and is waited for before the next; index checks JAX would skip (embedding,
  index_select, gather); optional NaN check (``torch.tpu.set_nan_check(True)``).
- "strict": every op is its own cached XLA program, dispatched asynchronously.
- "fused": ops are recorded and run as one cached XLA program at a sync point.

Ints that change at the same place of an op (a decode position, a view's storage offset) become
runtime inputs after their second value, so decoding compiles once (``set_dynamic_scalars``; env
``TPUDIST_DYNAMIC_SCALARS=0`` turns it off; docs/decoding.md).

The packages above (the process group, the compile backend) use the device through
``tpudist.device.interop`` only; the underscored modules are the device's own.
"""

from __future__ import annotations

import torch

from tpudist.device import _runtime

_NAME = "tpu"


def _install() -> None:
    current = torch._C._get_privateuse1_backend_name()  # noqa: SLF001
    if current == _NAME and hasattr(torch, _NAME):
        return
    if current != "privateuseone":
        raise RuntimeError(f"torch's PrivateUse1 backend is already named {current!r} in this process (torchax "
                           f"names it 'jax' on import); tpudist.device cannot also install {_NAME!r}: "
                           "use one of them per process")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from tpudist.device import (
        _accelerate, _accelerator, _attention, _autocast, _compile_default, _fsdp, _hooks, _kernels, _module, _pinned,
        _safetensors, _serialization, _storage,
    )

    module = _module.build_module()
    # First: torch keeps the first hooks object, and the setup below then skips its Python one
    cpp_hooks = _hooks.install()
    _setup_privateuseone_for_python_backend(_NAME, backend_module=module)
    if cpp_hooks:
        _storage.connect_hooks()
        _module.use_default_generator(module, _hooks.default_generator())
    _kernels.register()
    _autocast.register()
    _attention.register()
    _serialization.register()
    _safetensors.register()
    if not cpp_hooks:
        _fsdp.register()  # the C++ hooks resize tpu storages: FSDP2's own free/alloc work
    _pinned.register(cpp_allocator=cpp_hooks)
    _accelerator.register()
    _accelerate.register()
    _compile_default.register()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_after_optimizer_step)
    from tpudist.device import _blocks

    if _blocks.enabled():  # read once, here: the hooks must see the model's first forward
        _blocks.install()
    from tpudist.device import _opaque

    _opaque.hide_from_dynamo()  # last: every device module is loaded by now


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    if _runtime.get_mode().records:
        from tpudist.device import _fused

        _fused.flush()


_install()

from tpudist.device._module import (  # noqa: E402
    cache_stats, clear_kernel_cache, eager_mode, get_eager_mode, set_cpu_fallback, set_eager_mode, set_nan_check,
    synchronize,
)

from tpudist.device._runtime import dynamic_scalars, set_dynamic_scalars  # noqa: E402

__all__ = ["cache_stats", "clear_kernel_cache", "dynamic_scalars", "eager_mode", "get_eager_mode", "set_cpu_fallback",
           "set_dynamic_scalars", "set_eager_mode", "set_nan_check", "synchronize"]
