"""torch.compile(backend="tpu") on "tpu" process groups: FSDP2 with compiled blocks, tensor parallelism
with the collectives inside the program, and ranks that compile different graphs.

The references are the same code run eagerly on the same ranks, from the same initial weights.
"""

from __future__ import annotations

import pytest

ARGS = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _batch(step: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, ARGS["vocab_size"], (2, 16), generator=gen)
    return tokens, torch.randint(0, ARGS["vocab_size"], (2, 16), generator=gen)


def fsdp_compiled_blocks(steps: int = 10, tp: int = 1):
    """Losses and full parameters of FSDP2 training (with tensor parallelism over ``tp`` ranks: a
    (dp, tp) mesh), eager vs each block's forward compiled."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tpudist.compile.program import STATS
    from tpudist.training.model import ModelArgs, Transformer
    from tpudist.training.parallelize import apply_tp

    torch._dynamo.reset()  # noqa: SLF001
    world = dist.get_world_size()
    mesh_2d = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    mesh = mesh_2d["dp"]
    runs = {}
    programs_before = len(STATS.collective_programs)
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**ARGS))
        if tp > 1:
            apply_tp(model, mesh_2d["tp"])
        for block in model.layers:
            if compiled:
                block.forward = torch.compile(block.forward, backend="tpu", fullgraph=True, dynamic=False)
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, freed = [], []
        graphs_after_step1 = None
        for step in range(steps):
            tokens, targets = _batch(step, dist.get_rank())
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            # reshard_after_forward freed each block's gathered parameters with storage.resize_(0):
            # only possible if the compiled blocks left their storages resizable.
            freed.append(all(p.untyped_storage().size() == 0 for fsdp_param in
                             model.layers[0]._get_fsdp_state()._fsdp_param_group.fsdp_params  # noqa: SLF001
                             for p in fsdp_param.all_gather_outputs))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0:
                graphs_after_step1 = STATS.graphs
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        runs[compiled] = (losses, full, freed, STATS.graphs - graphs_after_step1)
    runs["collective_programs"] = STATS.collective_programs[programs_before:]
    return runs


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["fsdp2-2ranks", "fsdp2+tp-2x2"])
def test_fsdp2_compiled_blocks_match_eager(world, tp, request):
    import torch

    pool = request.getfixturevalue(f"pool{world}")
    for rank, runs in enumerate(pool.run(fsdp_compiled_blocks, 10, tp, timeout=300)):
        # with TP the blocks' (shared) forward and backward programs hold the all-reduces; FSDP's stay eager
        programs = runs["collective_programs"]
        assert [name for name, _ in programs] == (["forward", "backward"] if tp > 1 else []), programs
        assert all("all-reduce" in ops for _, ops in programs), programs
        (eager_losses, eager_params, _, _), (losses, params, freed, new_graphs) = runs[False], runs[True]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-5)
        for got, want in zip(params, eager_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert all(freed), f"rank {rank}: FSDP2 could not free the gathered parameters: {freed}"
        assert new_graphs == 0, f"rank {rank}: {new_graphs} graphs compiled after step 1"


def tp_compiled_block(steps: int = 3):
    """A tensor-parallel decoder block, compiled whole, against the same block eager; counts the eager
    c10d calls made while the compiled block runs forward and backward."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tpudist.compile.program import STATS
    from tpudist.process_group.channel import Channel
    from tpudist.training.model import ModelArgs, Transformer
    from tpudist.training.parallelize import apply_tp

    torch._dynamo.reset()  # noqa: SLF001
    torch.manual_seed(0)
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = Transformer(ModelArgs(**ARGS))
    apply_tp(model, tp_mesh)
    eager = copy.deepcopy(model)
    block, eager_block = model.layers[0], eager.layers[0]
    compiled = torch.compile(block, backend="tpu", fullgraph=True, dynamic=False)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    calls = [0]
    original = Channel.enqueue  # every eager collective passes here

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    before = len(STATS.collective_programs)
    out_err, grad_err = [], []
    for step in range(steps):
        x = torch.randn(2, 16, ARGS["dim"], generator=torch.Generator().manual_seed(step))
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        Channel.enqueue = counting
        try:
            y = compiled(x_c, cos, sin)
            y.pow(2).sum().backward()
        finally:
            Channel.enqueue = original
        y_e = eager_block(x_e, cos, sin)
        y_e.pow(2).sum().backward()
        out_err.append((y - y_e).abs().max().item())
        grad_err.append(max([(x_c.grad - x_e.grad).abs().max().item()] +
                            [(_full(a.grad) - _full(b.grad)).abs().max().item()
                             for a, b in zip(block.parameters(), eager_block.parameters())]))
    return out_err, grad_err, calls[0], STATS.collective_programs[before:]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_tp_block_collectives_inside_the_program(pool2):
    for rank, (out_err, grad_err, eager_calls, programs) in enumerate(pool2.run(tp_compiled_block, timeout=300)):
        assert max(out_err) <= 1e-5 and max(grad_err) <= 1e-5, (rank, out_err, grad_err)
        assert eager_calls == 0, f"rank {rank}: {eager_calls} eager c10d calls inside the compiled region"
        # forward: the all-reduces of wo and w2; backward: the all-reduces of the input gradient
        assert [name for name, _ in programs] == ["forward", "backward"], programs
        assert all("all-reduce" in ops for _, ops in programs), programs


def divergent_graphs():
    """Ranks running different compiled graphs must all raise, not hang: (a) both compile new graphs
    of different shapes, (b) rank 0 reruns an agreed program while rank 1 brings a new one."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tpudist.sharding import PlanMismatch

    torch._dynamo.reset()  # noqa: SLF001

    def fn(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    rank = dist.get_rank()
    same = compiled(torch.ones(4)).tolist()  # every rank the same graph first: agreed, runs
    outcomes = []
    for size in (6 + rank, 4 if rank == 0 else 9):
        try:
            compiled(torch.ones(size))
            outcomes.append("no error")
        except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error
            cause = e
            while cause is not None and not isinstance(cause, PlanMismatch):
                cause = cause.__cause__ or cause.__context__
            outcomes.append(type(cause).__name__ if cause is not None else repr(e))
    after = compiled(torch.ones(4)).tolist()  # the ranks are still in step afterwards
    return same, outcomes, after


def test_rank_divergent_graphs_raise(pool2):
    for same, outcomes, after in pool2.run(divergent_graphs, timeout=120):
        assert same == after == [5.0] * 4  # (1 * 2) summed over 2 ranks, + 1
        assert outcomes == ["PlanMismatch", "PlanMismatch"], outcomes


def funcol_ops():
    """Each functional collective inside one compiled graph against the same calls eagerly (gloo-free:
    eager funcol runs on the "tpu" group's own c10d collectives)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tpudist.compile.program import STATS

    torch._dynamo.reset()  # noqa: SLF001
    group = dist.group.WORLD

    def fn(x, y):
        a = funcol.all_reduce(x, "avg", group)
        b = funcol.all_reduce(x, "max", group)
        c = funcol.all_gather_tensor(y, 0, group)
        d = funcol.reduce_scatter_tensor(c * 3, "sum", 0, group)
        e = funcol.all_to_all_single(y + 1, None, None, group)
        f = funcol.reduce_scatter_tensor(c, "max", 0, group)
        g = funcol.broadcast(x + 1, 1, group)
        return a, b, c, d, e, f, g

    rank = dist.get_rank()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) - 2
    y = torch.arange(8, dtype=torch.int64).reshape(4, 2) + 10 * rank  # int64: an uneven-dtype mix
    before = len(STATS.collective_programs)
    got = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)(x, y)
    want = fn(x, y)
    return ([(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)) for g, w in zip(got, want)],
            STATS.collective_programs[before:])


def test_functional_collectives_match_eager(pool2):
    for same, programs in pool2.run(funcol_ops, timeout=120):
        assert same == [True] * 7, same
        assert len(programs) == 1 and {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"} <= set(programs[0][1]), programs


def two_axis_graph():
    """Collectives on both axes of a 2x2 DeviceMesh in one compiled graph = the same funcol calls eagerly."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from tpudist.compile.program import STATS

    torch._dynamo.reset()  # noqa: SLF001
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def fn(x):
        a = funcol.all_reduce(x * 2, "sum", (mesh, 1))  # over tp: ranks {0,1} / {2,3}
        b = funcol.all_gather_tensor(a + 1, 0, (mesh, 0))  # over dp: ranks {0,2} / {1,3}
        return funcol.reduce_scatter_tensor(b, "avg", 0, (mesh, 1)), a

    x = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (dist.get_rank() + 1)
    before = len(STATS.collective_programs)
    got = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)(x)
    want = fn(x)
    return [torch.equal(g, w) for g, w in zip(got, want)], STATS.collective_programs[before:]


def test_two_mesh_axes_in_one_program(pool4):
    for same, programs in pool4.run(two_axis_graph, timeout=180):
        assert same == [True, True], same
        assert len(programs) == 1 and {"all-reduce", "all-gather", "reduce-scatter"} <= set(programs[0][1]), programs


def recipe_losses(compile_blocks: bool):
    from tpudist.training import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(steps=3, log_every=10 ** 6, compile=compile_blocks))
    try:
        return [m.loss for m in trainer.train()]
    finally:
        trainer.close()


def test_recipe_compile_flag(pool2):
    """The recipe's --compile (FSDP2, each block's forward compiled) trains like the eager recipe."""
    import torch

    eager = pool2.run(recipe_losses, False, timeout=300)[0]
    compiled = pool2.run(recipe_losses, True, timeout=300)[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)
