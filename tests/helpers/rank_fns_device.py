"""Rank-side functions of tests/device/test_device_dist.py: training and collectives on "tpu" device tensors.

Every function imports ``tpudist.device`` itself (the pytest process never does). A training run is
described by :class:`Run` and done twice on the same ranks: on tpu tensors over the "tpu" process
groups, and on CPU tensors over gloo groups (the reference); the test compares the parameters.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.1  # at 0.5 the device's XLA kernels and torch's CPU kernels drift apart by 1.1e-6 in 3 steps


@dataclasses.dataclass(frozen=True)
class Run:
    kind: str  # "ddp" | "fsdp" (fully_shard over dp axes; HSDP with dp_replicate > 1) + tp if tp > 1
    mesh: tuple[int, int, int] = (1, 2, 1)  # dp_replicate, dp_shard, tp
    reshard_after_forward: bool | int = True
    device: str = "tpu"  # "tpu": tpu tensors, "tpu" groups; "cpu": CPU tensors, gloo groups
    mode: str = "strict"  # the device's eager mode


def _model_args():
    from tpudist.training.model import ModelArgs

    return ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8)


def _make_model():
    from tpudist.training.model import Transformer

    torch.manual_seed(0)
    model = Transformer(_model_args())
    for param in model.parameters():
        if param.ndim == 2:
            torch.nn.init.normal_(param, std=0.3)
    return model


def _mesh(run: Run):
    """The run's DeviceMesh: ``init_device_mesh`` on the run's device; gloo groups for CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(n for n, s in zip(("dp_replicate", "dp_shard", "tp"), run.mesh) if s > 1 or n == "dp_shard")
    shape = tuple(s for n, s in zip(("dp_replicate", "dp_shard", "tp"), run.mesh) if n in names)
    if run.device == "cpu":
        return init_device_mesh("cpu", shape, mesh_dim_names=names,
                                backend_override={name: "gloo" for name in names})
    return init_device_mesh("tpu", shape, mesh_dim_names=names)


def train(run: Run) -> dict[str, torch.Tensor]:
    """STEPS SGD steps of the small Llama; the full parameters afterwards (on the CPU)."""
    import tpudist.device  # noqa: F401
    from tpudist.training.data import MarkovTask
    from tpudist.training.equivalence import full_parameters
    from tpudist.training.parallelize import apply_fsdp, apply_tp, dp_coordinate, dp_mesh

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    mesh = _mesh(run)
    frees = []
    free_storage = _fsdp_param.free_storage  # tpudist.device's wrapper (tpudist/device/_fsdp.py)

    def counting_free(tensor):
        frees.append(tensor.device.type)
        return free_storage(tensor)

    _fsdp_param.free_storage = counting_free
    model = _make_model().to(run.device)
    if "tp" in mesh.mesh_dim_names:
        apply_tp(model, mesh["tp"])
    if run.kind == "ddp":
        group = mesh["dp_shard"].get_group()
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    else:
        apply_fsdp(model, dp_mesh(mesh), reshard_after_forward=run.reshard_after_forward)
    dp_rank, dp_size = dp_coordinate(mesh)
    task = MarkovTask(vocab_size=32, seq_len=8, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    try:
        with torch.tpu.eager_mode(run.mode):
            for step in range(STEPS):
                inputs, targets = task.batch(step, GLOBAL_BATCH, dp_rank, dp_size)
                inputs, targets = inputs.to(run.device), targets.to(run.device)
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            params = {k: v.cpu() for k, v in full_parameters(model).items()}
    finally:
        _fsdp_param.free_storage = free_storage
    return {"params": params, "losses": losses, "devices": sorted({str(p.device) for p in model.parameters()}),
            "frees": sorted(set(frees))}


def dtensor_ops(device: str) -> dict[str, torch.Tensor]:
    """DTensor on ``init_device_mesh(device, (world,))``: distribute (even and uneven), redistribute
    through every collective a 1-D mesh uses, a sharded matmul; the results on the CPU."""
    import tpudist.device  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    n = dist.get_world_size()
    override = {0: "gloo"} if device == "cpu" else None
    mesh = init_device_mesh(device, (n,), backend_override=override)
    torch.manual_seed(0)
    x, w = torch.randn(4 * n, 6), torch.randn(6, 2 * n)
    uneven = torch.randn(2 * n + 1, 3)  # 5 rows on 2 ranks, 9 on 4: shards of different sizes
    out = {}
    dx = distribute_tensor(x.to(device), mesh, [Shard(0)])
    dw = distribute_tensor(w.to(device), mesh, [Replicate()])
    out["matmul"] = (dx @ dw).full_tensor()  # Shard(0) x Replicate -> Shard(0), then all_gather
    out["s0_to_s1"] = dx.redistribute(mesh, [Shard(1)]).to_local()  # all_to_all
    out["s1_to_r"] = dx.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).to_local()
    partial = dx.to_local().sum(0, keepdim=True)
    dp = torch.distributed.tensor.DTensor.from_local(partial, mesh, [Partial()])
    out["partial_to_r"] = dp.redistribute(mesh, [Replicate()]).to_local()  # all_reduce
    out["partial_to_s0"] = dp.redistribute(mesh, [Shard(1)]).to_local()  # reduce_scatter
    du = distribute_tensor(uneven.to(device), mesh, [Shard(0)])
    out["uneven_local"] = du.to_local()
    out["uneven_full"] = du.full_tensor()
    out["uneven_to_s1"] = du.redistribute(mesh, [Shard(1)]).to_local()
    out["devices"] = sorted({str(t.device) for t in (dx.to_local(), du.to_local())})
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


_CONVERSIONS = {  # module -> names: every way a tensor's data reaches the host on the collective paths
    "tpudist.process_group.tensors": ("as_numeric", "as_bytes", "raw", "write_numeric", "write_bytes",
                                      "_copy_into"),
    "tpudist.device._storage": ("to_torch", "to_jax", "to_cpu", "from_cpu"),
}


def no_host_copy(sabotage: bool = False) -> dict:
    """Device collectives, watched: host conversions are counted, and the buffers are followed from
    the tensors' storages through a call's three device programs (read, collective, write) back
    into the storages.

    ``sabotage``: the pieces take a detour through host memory on their way into the collective
    program (what a host copy would do); the check must see it.
    """
    import importlib

    import numpy as np

    import tpudist.device  # noqa: F401
    from tpudist.device import _storage
    from tpudist.process_group import device_arrays

    counts: dict[str, int] = {}
    saved = []

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)

        saved.append((module, name, original))
        setattr(module, name, wrapper)

    for module_name, names in _CONVERSIONS.items():
        module = importlib.import_module(module_name)
        for name in names:
            counted(module, name)

    def pointers(arrays):
        return [(a.addressable_data(0) if len(a.sharding.device_set) > 1 else a).unsafe_buffer_pointer()
                for a in arrays]

    stages = []  # (stage, input buffer pointers, output buffer pointers) of each device program

    def watched(stage, fn, *args):
        result = original_execute(stage, fn, *args)
        if stage == "read":
            stages.append((stage, pointers(args[0]), pointers(result[1])))
        elif stage == "collective":
            stages.append((stage, pointers(args[1:]), pointers(result[0])))
        else:
            stages.append((stage, pointers(args[2]), pointers(result)))
        return result

    original_execute, original_put = device_arrays.execute, device_arrays._put
    device_arrays.execute = watched
    if sabotage:
        device_arrays._put = lambda aval, sharding, local, device: original_put(
            aval, sharding, np.array(local), device)

    def storage_pointer(t):
        return _storage.buffer_of(t).value.unsafe_buffer_pointer()

    r, n = dist.get_rank(), dist.get_world_size()
    results, checks = {}, []

    def check(name, run, inputs, outputs):
        """One call: the storages' buffers are the read program's inputs, its pieces the collective's
        inputs, the collective's outputs the write program's inputs, its outputs the storages'; no
        host conversion runs meanwhile."""
        before = {storage_pointer(t) for t in inputs}
        start, counted_before = len(stages), dict(counts)
        run()
        (_, read_in, pieces), (_, coll_in, coll_out), (_, write_in, write_out) = stages[start:]
        after = {storage_pointer(t) for t in outputs}
        checks.append((name, set(read_in) == before, coll_in == pieces, write_in == coll_out,
                       after == set(write_out)))
        for key, value in counts.items():
            host[key] = host.get(key, 0) + value - counted_before.get(key, 0)

    def tpu(t):  # made on the CPU and moved (the device's own factories are not what is tested)
        return t.to("tpu")

    host: dict[str, int] = {}
    try:
        t = tpu(torch.arange(6.0) * (r + 1))
        check("all_reduce", lambda: dist.all_reduce(t), [t], [t])
        results["all_reduce"] = t
        flat = tpu(torch.zeros(4 * n))  # FSDP2's layout: the input is a chunk of the output
        chunk = flat.narrow(0, 4 * r, 4)
        chunk.copy_(tpu(torch.full((4,), float(r))))
        check("all_gather_into_tensor", lambda: dist.all_gather_single(flat, chunk), [flat], [flat])
        results["all_gather_into_tensor"] = flat
        grads, shard = tpu(torch.arange(4.0 * n) + r), tpu(torch.zeros(4))
        check("reduce_scatter_tensor", lambda: dist.reduce_scatter_single(shard, grads), [grads, shard],
              [shard])
        results["reduce_scatter_tensor"] = shard
        b = tpu(torch.full((3,), float(r + 7)))
        check("broadcast", lambda: dist.broadcast(b, src=n - 1), [b], [b] if r != n - 1 else [])
        results["broadcast"] = b
        a = tpu(torch.arange(2.0 * n) + 10 * r)
        a_out = tpu(torch.zeros(2 * n))
        check("all_to_all_single", lambda: dist.all_to_all_single(a_out, a), [a, a_out], [a_out])
        results["all_to_all_single"] = a_out
        # Controls: the counters do see the host paths.
        dist.all_reduce(torch.ones(2))
        t.cpu()
        controls = dict(counts)
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        device_arrays.execute, device_arrays._put = original_execute, original_put
    return {"checks": checks, "host_conversions": host, "controls": controls,
            "results": {k: v.cpu() for k, v in results.items()},
            "storage_types": sorted({type(_storage.buffer_of(v).value).__name__ for v in results.values()})}


def mixed_devices() -> dict:
    """cpu and tpu tensors in one call; tpu on rank 0 against cpu on rank 1; send of a tpu tensor;
    an expanded view as an output."""
    import tpudist.device  # noqa: F401

    r = dist.get_rank()
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors[name] = f"{type(e).__name__}: {e}"

    attempt("one_call", lambda: dist.all_gather([torch.zeros(2), torch.zeros(2, device="tpu")],
                                                torch.ones(2, device="tpu")))
    attempt("across_ranks", lambda: dist.all_reduce(torch.ones(2, device="tpu") if r == 0 else torch.ones(2)))
    attempt("send", lambda: dist.send(torch.ones(2, device="tpu"), dst=1) if r == 0 else dist.recv(torch.ones(2), src=0))
    attempt("expanded_output", lambda: dist.all_reduce(torch.ones(1, device="tpu").expand(3)))
    t = torch.ones(2, device="tpu")
    dist.all_reduce(t)
    errors["after"] = t.cpu().tolist()
    return errors


def collectives(device: str) -> dict[str, torch.Tensor]:
    """The c10d ops the training runs do not reach, on ``device`` tensors: uneven splits, roots,
    list and coalesced forms, reduce ops, dtypes, a strided view as the in-place tensor."""
    import tpudist.device  # noqa: F401

    r, n = dist.get_rank(), dist.get_world_size()
    T = lambda t: t.to(device)
    out = {}
    t = T(torch.arange(5.0) + r); dist.reduce(t, dst=1); out["reduce"] = t
    t = T(torch.arange(3.0) + 10 * r); g = [T(torch.zeros(3)) for _ in range(n)] if r == 0 else None
    dist.gather(t, g, dst=0); out["gather"] = torch.stack(g) if g else torch.zeros(0)
    o = T(torch.zeros(2)); sl = [T(torch.full((2,), float(i))) for i in range(n)] if r == 1 else None
    dist.scatter(o, sl, src=1); out["scatter"] = o
    insp = [1, 2] if r == 0 else [2, 2]  # rank 0 sends 1 to itself and 2 to rank 1; rank 1 2 and 2
    outsp = [1, 2] if r == 0 else [2, 2]
    a = T(torch.zeros(sum(outsp))); dist.all_to_all_single(a, T(torch.arange(float(sum(insp))) + 100 * r), outsp, insp); out["a2a_uneven"] = a
    outs = [T(torch.zeros(2)) for _ in range(n)]; dist.all_to_all(outs, [T(torch.full((2,), 10.0 * r + i)) for i in range(n)]); out["a2a_list"] = torch.cat(outs)
    ts = [T(torch.ones(3) * (r + 1)), T(torch.arange(2.0))]; dist.all_reduce_coalesced(ts); out["ar_coal"] = torch.cat(ts)
    ol = [[T(torch.zeros(2)), T(torch.zeros(1))] for _ in range(n)]; dist.all_gather_coalesced(ol, [T(torch.full((2,), float(r))), T(torch.full((1,), 5.0 + r))]); out["ag_coal"] = torch.cat([x for row in ol for x in row])
    rs = T(torch.zeros(2)); dist.reduce_scatter(rs, [T(torch.full((2,), float(i + r))) for i in range(n)]); out["rs_list"] = rs
    m = T(torch.tensor([3.0, -1.0]) * (r + 1)); dist.all_reduce(m, dist.ReduceOp.MAX); out["max"] = m
    p = T(torch.tensor([2, 3], dtype=torch.int32) + r); dist.all_reduce(p, dist.ReduceOp.PRODUCT); out["prod"] = p
    av = T(torch.tensor([1.0, 3.0]) * (r + 1)); dist.all_reduce(av, dist.ReduceOp.AVG); out["avg"] = av
    bf = T(torch.tensor([1.5, 2.25], dtype=torch.bfloat16) * (r + 1)); dist.all_reduce(bf); out["bf16"] = bf.float()
    i64 = T(torch.tensor([2**40 + r], dtype=torch.int64)); dist.all_reduce(i64); out["i64"] = i64
    big = T(torch.arange(5000.0) * (r + 1)); dist.all_reduce(big); out["big"] = big
    v = T(torch.zeros(4, 3)); col = v[:, 1]; col.copy_(T(torch.arange(4.0) + r)); dist.all_reduce(col); out["strided_view"] = v
    return {k: x.cpu() for k, x in out.items()}


def train_hf(kind: str, device: str, mode: str = "strict") -> dict:
    """Hugging Face code as users run it, sharded: a tiny ``LlamaForCausalLM`` (``kind="fsdp"``:
    ``fully_shard`` on every decoder layer, then the root) or ``GPT2LMHeadModel`` (``kind="ddp"``:
    its Conv1D layers, tied embeddings) with its own loss (``labels=``, a padded batch with an
    attention mask and ignored labels), AdamW with weight decay and ``clip_grad_norm_``. Returns
    the losses and the full parameters afterwards (on the CPU)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tpudist.device  # noqa: F401
    from tpudist.training.equivalence import full_parameters

    if device == "cpu":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), backend_override={0: "gloo"})
    else:
        mesh = init_device_mesh("tpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    if kind == "fsdp":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=32))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    model = model.to(device)
    if kind == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence is padded at the end
    labels = ids.masked_fill(mask == 0, -100)
    losses, norms = [], []
    with torch.tpu.eager_mode(mode):
        for _ in range(STEPS):  # one batch per rank, every step: the loss must fall
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            out.loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        params = {k: v.cpu() for k, v in full_parameters(model).items()}
    return {"params": params, "losses": losses, "norms": norms,
            "devices": sorted({str(p.device) for p in model.parameters()})}
