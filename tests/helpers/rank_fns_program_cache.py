"""Rank-side functions of tests/compile/test_program_cache.py: ranks of one world sharing a cache."""

from __future__ import annotations


def compile_in_turn():
    """Rank 0 compiles a model's step and a fused-like program first; rank 1 after it, same programs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tpudist import program_cache
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
            out = {"loss": loss.item(), "grad": model[0].weight.grad.norm().item(),
                   "fused": np.asarray(fused).ravel().tolist(), "device": str(device),
                   "compile": STATS.snapshot(),
                   "cache": {k: program_cache.stats(k).snapshot() for k in ("compile", "test_fused")}}
        dist.barrier()
    return out


def collectives():
    """An all_reduce and an all_gather too large for the envelope exchange, and a small all_reduce;
    the values, and how many XLA executables this rank compiled or read from the program cache."""
    import torch
    import torch.distributed as dist

    from tpudist import program_cache
    from tpudist.process_group.programs import cache_stats

    rank, n = dist.get_rank(), dist.get_world_size()
    big = torch.arange(50_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(big)
    gathered = [torch.empty(50_000) for _ in range(n)]
    dist.all_gather(gathered, torch.full((50_000,), float(rank)))
    small = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(small, op=dist.ReduceOp.MAX)
    stats = cache_stats()
    return {"big": big[:3].tolist(), "gathered": [g[-1].item() for g in gathered], "small": small.item(),
            "xla_compiles": stats.xla_compiles, "xla_loaded": stats.xla_loaded,
            "cache": program_cache.stats("collective").snapshot()}


def compiled_all_reduce():
    """A compiled graph with a functional all_reduce inside (one XLA program over the world)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tpudist.compile.program import STATS

    def fn(x):
        return funcol.all_reduce(torch.sin(x), "sum", dist.group.WORLD) + 1

    x = torch.linspace(-1, 1, 8) * (dist.get_rank() + 1)
    got = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)(x)
    want = sum(torch.sin(torch.linspace(-1, 1, 8) * (r + 1)) for r in range(dist.get_world_size())) + 1
    return {"err": (got - want).abs().max().item(), "collective_programs": STATS.collective_programs,
            **STATS.snapshot()}
