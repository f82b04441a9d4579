"""Rank-side functions of tests/compile/test_program_cache.py: ranks of one world sharing a cache."""

from __future__ import annotations


def compile_in_turn():
    """Rank 0 compiles a model's step, a fused-like program and a Fused computation on the tpu device
    (read back to the host) first; rank 1 after it, same programs. Every XLA compile of the device
    computation (whatever asked JAX for it) is counted."""
    import jax
    import jax._src.compiler as jax_compiler
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401 - before any backward (COMMON.md)
    from tpudist.runtime import program_cache
    from tpudist.compile.program import STATS
    from tpudist.process_group import runtime

    out = {}
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            step = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="tpu", fullgraph=True,
                                 dynamic=False)
            loss = step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
            loss.backward()
            device = runtime.current().local_device
            spec = jax.ShapeDtypeStruct((4, 4), np.float32)
            loaded = program_cache.load_or_export(
                "test_fused", ("matmul+tanh", (4, 4)),
                lambda: jax.export.export(jax.jit(lambda a: jnp.tanh(a @ a) * 0 + a))(spec))
            x = jax.device_put(np.full((4, 4), dist.get_rank() + 1.0, np.float32), device)
            fused = jax.jit(loaded.exported.call)(x)
            assert fused.devices() == {device}, fused.devices()

            compiles, original = [], jax_compiler.backend_compile_and_load

            def counted(backend, module, devices, *args, **kwargs):
                compiles.append(str(module.operation.attributes["sym_name"]).strip('"'))
                return original(backend, module, devices, *args, **kwargs)

            jax_compiler.backend_compile_and_load = counted
            try:
                torch.tpu.set_eager_mode("fused")
                a = (torch.arange(12.0).reshape(3, 4) * (dist.get_rank() + 1)).to("tpu")
                on_device = (torch.tanh(a @ a.T / 200) + a.sum()).cpu()
            finally:
                jax_compiler.backend_compile_and_load = original
                torch.tpu.set_eager_mode("strict")
            device_stats = torch.tpu.cache_stats()
            out = {"loss": loss.item(), "grad": model[0].weight.grad.norm().item(),
                   "fused": np.asarray(fused).ravel().tolist(), "device": str(device),
                   "on_device": on_device.tolist(), "device_compiles": compiles,
                   "device_programs": device_stats["programs"], "readers": device_stats["readers"],
                   "compile": STATS.snapshot(),
                   "cache": {k: program_cache.stats(k).snapshot()
                             for k in ("compile", "compile_xla", "test_fused", "fused_xla", "reader")}}
        dist.barrier()
    return out


def one_of_each():
    """A rank's programs of every kind, phase by phase: a Fused training step on the tpu device
    ("fused"), a compiled step on CPU tensors (forward and backward graphs) and a compiled graph with
    a functional all_reduce ("compiled"), eager collectives on CPU tensors and on tpu tensors
    ("collectives"), ``tpudist.sharding``'s redistribute of uneven shards and an spmd program
    ("sharding"), then the values read back ("read"). Returns the values, the cache counters,
    and every XLA compile of the process (JAX's ``backend_compile_and_load``, whatever asked for
    it) as (phase, module name, number of devices)."""
    import jax._src.compiler as jax_compiler
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401 - before any backward (COMMON.md)
    from tpudist.runtime import program_cache
    from tpudist.compile.program import STATS
    from tpudist.process_group.programs import cache_stats

    compiles, phase = [], ["fused"]
    original = jax_compiler.backend_compile_and_load

    def counted(backend, module, devices, *args, **kwargs):
        compiles.append((phase[0], str(module.operation.attributes["sym_name"]).strip('"'), len(devices)))
        return original(backend, module, devices, *args, **kwargs)

    jax_compiler.backend_compile_and_load = counted
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        torch.tpu.set_eager_mode("fused")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to("tpu")
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        loss = F.cross_entropy(model(x.to("tpu")), y.to("tpu"))
        loss.backward()
        fused = [loss.item(), model[0].weight.grad.norm().item()]
        device_stats = torch.tpu.cache_stats()

        phase[0] = "compiled"
        torch.manual_seed(0)
        cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        step = torch.compile(lambda a, b: F.cross_entropy(cpu_model(a), b), backend="tpu", fullgraph=True,
                             dynamic=False)
        compiled_loss = step(x, y)
        compiled_loss.backward()
        graph = torch.compile(lambda a: funcol.all_reduce(torch.sin(a), "sum", dist.group.WORLD) + 1,
                              backend="tpu", fullgraph=True, dynamic=False)(torch.linspace(-1, 1, 8) * (rank + 1))

        phase[0] = "collectives"
        big = torch.arange(50_000, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(big)
        small = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(small, op=dist.ReduceOp.MAX)
        on_device = (torch.arange(6.0) * (rank + 1)).to("tpu")
        dist.all_reduce(on_device)
        gathered = torch.zeros(4 * n).to("tpu")
        dist.all_gather_single(gathered, torch.full((4,), float(rank)).to("tpu"))

        phase[0] = "sharding"
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from tpudist.sharding import redistribute, spmd

        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("x",))
        full = torch.arange(20.0).reshape(5, 4)  # 5 rows over 2 ranks: uneven shards
        with torch.no_grad():
            gathered_rows = redistribute(distribute_tensor(full, mesh, [Shard(0)]), [Replicate()]).to_local()
            scaled = spmd(lambda a: a.T * 2)(distribute_tensor(full, mesh, [Shard(1)])).full_tensor()

        phase[0] = "read"
        values = {"fused": fused, "compiled": [compiled_loss.item(), cpu_model[0].weight.grad.norm().item()],
                  "graph": graph.tolist(), "big": big[:3].tolist(), "small": small.item(),
                  "on_device": on_device.cpu().tolist(), "gathered": gathered.cpu().tolist(),
                  "rows": gathered_rows.tolist(), "scaled": scaled.tolist()}
    finally:
        jax_compiler.backend_compile_and_load = original
    collectives = cache_stats()
    return {"values": values, "compiles": compiles, "fused_programs": device_stats["programs"],
            "fused_from_disk": device_stats.get("programs_from_disk", 0), "graphs": STATS.snapshot(),
            "collectives": {"xla_compiles": collectives.xla_compiles, "xla_loaded": collectives.xla_loaded},
            "cache": {k: program_cache.stats(k).snapshot()
                      for k in ("fused", "fused_xla", "reader", "compile", "compile_xla", "collective")}}
