"""Rank-side functions of tests/device/test_device_dist_2.py: distributed training code as users write it
(FSDP2 mixed precision, gradient accumulation, activation checkpointing, CPU offload; DDP's no_sync,
unused parameters, static graph, bucket views, comm hooks; tensor parallelism on a Hugging Face Llama;
torch.distributed.checkpoint) on "tpu" tensors over "tpu" groups, or on CPU tensors over gloo (the
reference). Every function imports ``tpudist.device`` itself; results come back on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

LR = 0.1


def _mesh(device: str, shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    shape = shape or (dist.get_world_size(),)
    if device == "cpu":
        return init_device_mesh("cpu", shape, mesh_dim_names=names,
                                backend_override={i: "gloo" for i in range(len(shape))})
    return init_device_mesh("tpu", shape, mesh_dim_names=names)


def _llama():
    from tpudist.training.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8))
    for param in model.parameters():
        if param.ndim == 2:
            torch.nn.init.normal_(param, std=0.3)
    return model


def _batches(n: int, rows: int = 4):
    """``n`` (inputs, targets) batches of this rank (different on every rank)."""
    from tpudist.training.data import MarkovTask

    task = MarkovTask(vocab_size=32, seq_len=8, seed=1)
    return [task.batch(step, rows * dist.get_world_size(), dist.get_rank(), dist.get_world_size())
            for step in range(n)]


def _full(model) -> dict[str, torch.Tensor]:
    from tpudist.training.equivalence import full_parameters

    return {k: v.cpu() for k, v in full_parameters(model).items()}


def fsdp(case: str, device: str) -> dict:
    """FSDP2 ``fully_shard`` per block and on the root of the small Llama, 3 SGD steps, with ``case``:
    "mp" (bf16 parameters, fp32 gradient reduction), "mp_bf16_reduce" (bf16 parameters and reduction),
    "accum" (2 micro-batches per step, the first without gradient sync), "ac" (``checkpoint_wrapper`` on
    each block), "ac_fn" (``torch.utils.checkpoint`` inside a block's forward), "offload"
    (``CPUOffloadPolicy()``),
    "hsdp_accum" ("accum" on a (2, world / 2) mesh: HSDP)."""
    import tpudist.device  # noqa: F401
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = _mesh(device, (2, dist.get_world_size() // 2), ("replicate", "shard")) if case.startswith("hsdp") \
        else _mesh(device)
    model = _llama().to(device)
    kwargs = {}
    if case == "mp":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case == "mp_bf16_reduce":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gradients reduced in bf16
    if case == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()  # pin_memory=True: the C++ hooks' allocator (device/_hooks.py)
    if case == "ac":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if case == "ac_fn":
        import torch.utils.checkpoint as cp

        for block in model.layers:
            inner = block.forward
            block.forward = lambda *a, inner=inner: cp.checkpoint(inner, *a, use_reentrant=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    seen = set()  # (device, dtype) of the weights a linear layer computes with, of its output, of the gradients
    linear = model.layers[0].attention.wq if hasattr(model.layers[0], "attention") else None
    linear = linear or model.layers[0]._checkpoint_wrapped_module.attention.wq
    linear.register_forward_hook(lambda m, args, out: seen.add(("forward", str(m.weight.device), str(m.weight.dtype),
                                                                str(out.device), str(out.dtype))))
    micro = 2 if case.endswith("accum") else 1
    losses = []
    batches = _batches(3 * micro)
    for step in range(3):
        for m in range(micro):
            inputs, targets = batches[step * micro + m]
            model.set_requires_gradient_sync(m == micro - 1)
            loss = F.cross_entropy(model(inputs.to(device)).flatten(0, 1).float(), targets.to(device).flatten())
            (loss / micro).backward()
            losses.append(loss.item())
        seen.update(("grad", str(p.grad.device), str(p.grad.dtype)) for p in model.parameters())
        opt.step()
        opt.zero_grad()
    devices = sorted({str(p.device) for p in model.parameters()})
    return {"losses": losses, "params": _full(model), "devices": devices, "seen": sorted(seen)}


class _Branchy(torch.nn.Module):
    """An MLP with a branch that is not taken (``find_unused_parameters``)."""

    def __init__(self, branch: bool):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(8, 3) if branch else None

    def forward(self, x, take_branch: bool = False):
        h = torch.tanh(self.a(x))
        return self.unused(h) if take_branch else self.b(h)


def ddp(case: str, device: str) -> dict:
    """DDP of a small MLP over the world group, 3 SGD steps, with ``case``: "no_sync" (2 micro-batches,
    the first under ``no_sync()``), "unused" (``find_unused_parameters=True``, a branch never taken),
    "static" (``static_graph=True``, with the branch never taken), "bucket_view"
    (``gradient_as_bucket_view=True``, small buckets), "allreduce_hook", "fp16_hook", "powersgd"
    (``register_comm_hook``; torch's bf16_compress_hook refuses anything but NCCL/XCCL, gloo too),
    "autocast" (forward and loss under ``torch.autocast(device, dtype=torch.bfloat16)``)."""
    import tpudist.device  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    group = _mesh(device).get_group()
    torch.manual_seed(0)
    module = _Branchy(case in ("unused", "static")).to(device)
    kwargs = {"process_group": group}
    if case == "unused":
        kwargs["find_unused_parameters"] = True
    if case == "static":
        kwargs["static_graph"] = True
    if case == "bucket_view":
        kwargs.update(gradient_as_bucket_view=True, bucket_cap_mb=1e-4)
    if case == "no_sync":
        kwargs["bucket_cap_mb"] = 1e-4  # several buckets
    model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    hooks = {"allreduce_hook": default_hooks.allreduce_hook, "fp16_hook": default_hooks.fp16_compress_hook}
    if case in hooks:
        model.register_comm_hook(group, hooks[case])
    if case == "powersgd":  # rank-1 approximation from the 3rd step on (warm start, error feedback)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       min_compression_rate=0.5)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses, grads = [], []
    micro = 2 if case == "no_sync" else 1
    try:
        _ddp_steps(model, module, opt, gen, micro, device, losses, grads, autocast=case == "autocast")
    except NotImplementedError as e:  # returned, not raised: the pool's ranks stay up for the next test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"losses": losses, "grads": grads, "params": {n: p.detach().cpu() for n, p in module.named_parameters()},
            "devices": sorted({str(p.device) for p in module.parameters()})}


def _ddp_steps(model, module, opt, gen, micro, device, losses, grads, autocast=False):
    for _ in range(3):
        for m in range(micro):
            x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
            if m < micro - 1:
                with model.no_sync():
                    loss = F.cross_entropy(model(x.to(device)), y.to(device))
                    loss.backward()
            elif autocast:
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
            else:
                loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
            losses.append(loss.item())
        grads.append({n: p.grad.cpu().clone() for n, p in module.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()


def tp_hf(device: str, loss_parallel: bool = False) -> dict:
    """Tensor parallelism as users write it on an unmodified Hugging Face ``LlamaForCausalLM`` (random
    init, tiny config): ``parallelize_module`` with Colwise/Rowwise on the attention and MLP projections,
    the embedding Rowwise, the LM head Colwise (vocabulary-sharded logits and ``loss_parallel`` when
    asked); 3 AdamW steps on the same batch on every rank. (SequenceParallel on the norms does not fit
    HF Llama as is: its rotary embedding takes the sequence length from the local shard.)"""
    import transformers
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel as loss_parallel_ctx,
                                                   parallelize_module)

    import tpudist.device  # noqa: F401

    mesh = _mesh(device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    })
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))  # same batch on every rank
    losses = []
    for _ in range(3):
        logits = model(input_ids=ids.to(device)).logits
        labels = ids[:, 1:].to(device)
        if loss_parallel:
            with loss_parallel_ctx():
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return {"losses": losses, "params": _full(model),
            "devices": sorted({str(p.to_local().device if hasattr(p, "to_local") else p.device)
                               for p in model.parameters()})}


def dcp_resume(device: str, directory: str) -> dict:
    """FSDP2 small Llama with Adam: 2 steps, ``dcp.save`` of model and optimizer state
    (``get_state_dict``), 2 more steps; then a fresh model and optimizer ``dcp.load`` the checkpoint
    (``set_state_dict``) and take the same 2 steps. Both runs' final parameters and losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import tpudist.device  # noqa: F401

    mesh = _mesh(device)
    batches = _batches(4)

    def build():
        model = _llama().to(device)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def steps(model, opt, indices):
        out = []
        for i in indices:
            inputs, targets = batches[i]
            loss = F.cross_entropy(model(inputs.to(device)).flatten(0, 1), targets.to(device).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    model, opt = build()
    losses = steps(model, opt, [0, 1])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    losses += steps(model, opt, [2, 3])
    straight = _full(model)

    model2, opt2 = build()
    steps(model2, opt2, [3])  # move away from the checkpoint first: load must overwrite everything
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = steps(model2, opt2, [2, 3])
    devices = sorted({str(p.to_local().device) for p in model2.parameters()})
    return {"losses": losses, "resumed_losses": resumed_losses, "straight": straight, "resumed": _full(model2),
            "devices": devices}


def state_dict_round_trips(device: str, directory: str) -> dict:
    """What users do with an FSDP2 model's state outside ``dcp.save``: a full CPU state dict on rank 0
    (``StateDictOptions(full_state_dict=True, cpu_offload=True)``, to write a Hugging Face checkpoint),
    loading a full state dict that only rank 0 holds into a fresh sharded model
    (``broadcast_from_rank0=True``), and ``dcp.async_save`` then ``dcp.load``; if ``async_save`` of the
    model's own state dict raises, its error is returned and the state dict offloaded to the CPU
    (``StateDictOptions(cpu_offload=True)``) is saved instead. Returns what each saw."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import fully_shard

    import tpudist.device  # noqa: F401

    mesh = _mesh(device)
    inputs, targets = _batches(1)[0]

    def build(seed_shift: int = 0):
        model = _llama()
        if seed_shift:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(seed_shift)
        model = model.to(device)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    F.cross_entropy(model(inputs.to(device)).flatten(0, 1), targets.to(device).flatten()).backward()
    opt.step()
    out = {"trained": _full(model)}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_devices"] = sorted({str(v.device) for v in full.values()})
    out["full"] = {k: v.clone() for k, v in full.items()}
    fresh = build(seed_shift=1)
    set_model_state_dict(fresh, full if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["broadcast"] = _full(fresh)
    out["broadcast_devices"] = sorted({str(p.to_local().device) for p in fresh.parameters()})
    try:
        dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=directory).result()
    except RuntimeError as e:  # returned: the ranks stay up for the next test
        out["async_error"] = f"{type(e).__name__}: {e}"
        offloaded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
        out["offloaded_types"] = sorted({f"{type(v).__name__}:{getattr(v, 'device', '')}" for v in offloaded.values()})
        dcp.async_save({"model": offloaded}, checkpoint_id=directory).result()
    other = build(seed_shift=2)
    state = {"model": get_model_state_dict(other)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(other, state["model"])
    out["async"] = _full(other)
    return out
