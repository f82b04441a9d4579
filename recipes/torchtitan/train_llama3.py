"""torchtitan's Llama 3 debug model with FSDP2, tensor and pipeline parallelism on the "tpu" process group.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 recipes/torchtitan/train_llama3.py --device tpu   # 2 fsdp x 2 tp
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 recipes/torchtitan/train_llama3.py --device cpu
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 recipes/torchtitan/train_llama3.py --pp 2 --tp 1  # 2 pp x 2 fsdp
    python recipes/torchtitan/train_llama3.py --device cpu --dp-shard 1 --tp 1     # the reference: one process
    python recipes/torchtitan/train_llama3.py --help

torchtitan 0.3 does the parallelism: its ``ParallelDims`` builds the meshes, ``parallelize_llama``
applies its tensor-parallel plan (sequence parallel included; the "partial_dtensor" SPMD backend) and
FSDP2, its loss is vocab-parallel under TP, its ``clip_grad_norm_`` and ``dist_sum`` reduce across
the meshes; with ``--pp`` its ``pipeline_llm`` splits the layers into stages and runs its schedule
(1F1B by default) over the "pp" mesh, each stage with FSDP2/TP as above. Only the torchtitan
modules for the model and its parallelism are imported:
``pip install --no-deps torchtitan spmd_types==0.2.3 tyro docstring_parser``
is enough (its full requirements would also bring datasets, which pins huggingface_hub below 2).
The model is ``llama3_configs["debugmodel"]`` (6 layers, dim 256, vocab 2048); it trains on one
synthetic batch with AdamW. What a user adds on CPU-emulated chips (the functions under "CPU-launch
adaptations", and ``build_parallel_model``):

- ``import tpudist.device`` before torchtitan (``--device tpu``): torchtitan reads its device type once,
  at import; it is then "tpu", so its meshes, FSDP2 and DTensors put the model on the "tpu" device.
- torchtitan imports its expert-parallel Triton kernels at module level; Triton is CUDA-only and absent
  with torch's CPU build. A placeholder stands in for that module (Llama 3 never calls it).
- FlexAttention runs through torch.compile + Inductor and has no backward on CPU: the attention of every
  layer is torchtitan's causal SDPA, which computes the same for one unpacked document per row.
- ``--device cpu``: torchtitan falls back to device type "cuda" when torch reports no accelerator; its
  meshes must be on "cpu" for CPU tensors, so the recipe sets torchtitan's mesh device type to "cpu".
- ``init_process_group("tpu")`` before torchtitan sees the job (its ``init_distributed`` would pick
  nccl for an unknown device).
- torchtitan's sharding plan on the model config and its SPMD backend, set as its Trainer sets them.
- With ``--pp``: the loss handed to ``pipeline_llm`` returns ``(loss, extra)`` as its Trainer's does,
  the first stage gets the tokens and the last the labels, the step's loss is the last stage's
  microbatch losses summed over the data-parallel ranks, and ``clip_grad_norm_`` gets the pp mesh.
- The loss normalised as its trainer does (token sum over the global token count): its FSDP2 sums
  gradients. That reduction is a PREMUL_SUM, which gloo refuses, so the reference run is one process.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Sequence

import torch
import torch.distributed as dist

from tpudist.training.config import option, parse_config


@dataclasses.dataclass(frozen=True)
class TitanConfig:
    """Train torchtitan's Llama 3 debug model with its FSDP2 and TP on the "tpu" process group."""

    dp_shard: int = option(2, "FSDP2 degree (torchtitan's data_parallel_shard_degree)")
    tp: int = option(2, "tensor-parallel degree; pp * dp_shard * tp must equal the world size")
    pp: int = option(1, "pipeline-parallel degree (torchtitan's pipeline_llm: its stage split and schedule)")
    pp_schedule: str = option("1F1B", "torchtitan's pipeline schedule name (GPipe, 1F1B, Interleaved1F1B, ...)")
    microbatch_size: int = option(1, "rows per pipeline microbatch (pp > 1)")
    device: str = option("tpu", "where the model computes: tpu (the tpudist device) or cpu (torch's CPU kernels)",
                         ("tpu", "cpu"))
    backend: str = option("tpu", "c10d backend (gloo: the reference run, CPU tensors only)", ("tpu", "gloo"))
    spmd_backend: str = option("partial_dtensor", "torchtitan's parallelism code path: partial_dtensor (its "
                               "DTensor TP plan + FSDP2) or spmd_types (its experimental typed-SPMD path)",
                               ("partial_dtensor", "spmd_types"))
    steps: int = option(3, "AdamW steps (on one batch, seen every step)")
    n_layers: int = option(6, "transformer layers (the debug model has 6)")
    batch_size: int = option(4, "global batch (rows), split over the FSDP ranks")
    seq_len: int = option(32, "tokens per row")
    lr: float = option(1e-3, "AdamW learning rate")
    max_norm: float = option(1.0, "gradient clipping norm (torchtitan's clip_grad_norm_)")
    seed: int = option(0, "model and data seed")


@dataclasses.dataclass
class Result:
    """Per-step global mean loss and gradient norm, the same on every rank."""

    losses: list[float]
    grad_norms: list[float]
    param_device: str
    stages: list[int] = dataclasses.field(default_factory=list)  # pipeline stages this rank holds (pp > 1)


# -- CPU-launch adaptations --------------------------------------------------------------------------


def import_llama3(device: str) -> types.ModuleType:
    """torchtitan's Llama 3 package, imported so that it runs on CPU-emulated chips."""
    if device == "tpu":
        import tpudist.device  # noqa: F401  (before torchtitan: it reads the device type at import)
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            placeholder = types.ModuleType(name, "placeholder: Triton kernels are CUDA-only (recipes/torchtitan)")
            placeholder.__getattr__ = _triton_kernel_unavailable
            sys.modules[name] = placeholder
    from torchtitan.models import llama3

    if device == "cpu":
        from torchtitan.distributed import parallel_dims

        parallel_dims.device_type = "cpu"  # torchtitan's fallback is "cuda" when torch sees no accelerator
    return llama3


def _triton_kernel_unavailable(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)

    def call(*args, **kwargs):
        raise RuntimeError(f"torchtitan's Triton kernel {attr} needs CUDA and Triton; this process has neither")

    return call


def debug_model_config(llama3: types.ModuleType, n_layers: int):
    """The "debugmodel" flavor with causal SDPA in every layer (FlexAttention has no CPU backward)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


# -- the training ------------------------------------------------------------------------------------


def build_parallel_model(cfg: TitanConfig, llama3: types.ModuleType):
    """The debug model, initialised on the CPU from ``cfg.seed`` (the same weights for every layout),
    then parallelised by torchtitan: TP on the "tp" mesh, FSDP2 on the "fsdp" mesh."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(cfg.spmd_backend)  # what torchtitan's Trainer does first: its layers read it
    parallelism = ParallelismConfig(data_parallel_shard_degree=cfg.dp_shard, tensor_parallel_degree=cfg.tp,
                                    spmd_backend=cfg.spmd_backend)
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    model, _, _ = single_process_model(cfg, llama3, parallelism)
    model = llama3.parallelize_llama(
        model, parallel_dims=dims, parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        dump_folder="",
    )
    return model, dims, model.tok_embeddings.num_embeddings


def single_process_model(cfg: TitanConfig, llama3: types.ModuleType, parallelism=None):
    """The debug model on the CPU, initialised from ``cfg.seed``, and its vocabulary size.

    With a ``ParallelismConfig`` its layers carry torchtitan's sharding plan (TP, sequence parallel) for
    ``parallelize_llama`` to apply, set as torchtitan's Trainer sets it (its ``update_from_config``
    imports the whole Trainer, which needs torchdata and datasets: not needed here)."""
    config = debug_model_config(llama3, cfg.n_layers)
    if parallelism is not None:  # the part of Llama3Model.Config.update_from_config that needs no Trainer
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    torch.manual_seed(cfg.seed)
    model = config.build()
    model.init_states()
    return model, config.vocab_size, config


def build_pipeline(cfg: TitanConfig, llama3: types.ModuleType, device: torch.device, loss_fn):
    """The debug model split into pipeline stages by torchtitan's ``pipeline_llm`` (its layer split,
    its schedule over the "pp" mesh), each stage parallelised like the whole model otherwise (FSDP2
    on "fsdp", TP on "tp"). ``loss_fn(pred, labels)``: the last stage's loss per microbatch."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    dist_utils.set_spmd_backend(cfg.spmd_backend)
    parallelism = ParallelismConfig(data_parallel_shard_degree=cfg.dp_shard, tensor_parallel_degree=cfg.tp,
                                    pipeline_parallel_degree=cfg.pp, pipeline_parallel_schedule=cfg.pp_schedule,
                                    pipeline_parallel_microbatch_size=cfg.microbatch_size,
                                    spmd_backend=cfg.spmd_backend)
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    model, vocab_size, config = single_process_model(cfg, llama3, parallelism)
    training = TrainingConfig(local_batch_size=cfg.batch_size // cfg.dp_shard, mixed_precision_param="float32",
                              mixed_precision_reduce="float32")
    schedule, parts, has_first, has_last = pipeline_llm(
        model, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=CompileConfig(),
        ac_config=None, dump_folder="", device=device, model_config=config,
        parallelize_fn=llama3.parallelize_llama, loss_fn=lambda pred, labels: (loss_fn(pred, labels), None))
    stages = [stage.stage_index for stage in getattr(schedule, "_stages", [getattr(schedule, "_stage", None)])]
    return schedule, parts, dims, vocab_size, has_first, has_last, stages


def batch(cfg: TitanConfig, vocab_size: int, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch: FSDP ranks split it, TP ranks of one FSDP rank share rows."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    batch_mesh = dims.get_optional_mesh("batch") if dims is not None else None
    index, count = (batch_mesh.get_local_rank(), batch_mesh.size()) if batch_mesh is not None else (0, 1)
    rows = tokens.chunk(count)[index]
    return rows[:, :-1], rows[:, 1:]


def main(argv: Sequence[str] | None = None) -> Result:
    cfg = parse_config(TitanConfig, argv)
    llama3 = import_llama3(cfg.device)
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    device = torch.device(cfg.device)
    if cfg.pp > 1:
        return train_pipeline(cfg, llama3, device)
    if cfg.dp_shard * cfg.tp == 1:  # the reference: one process, no parallelism, the whole batch
        model, vocab_size, _ = single_process_model(cfg, llama3)
        loss_mesh, rank = None, 0
        model.to(device)
        inputs, labels = batch(cfg, vocab_size, None)
        where = "one process"
    else:
        if not dist.is_initialized():
            dist.init_process_group(cfg.backend)
        model, dims, vocab_size = build_parallel_model(cfg, llama3)
        inputs, labels = batch(cfg, vocab_size, dims)
        loss_mesh, rank = dims.get_optional_mesh("loss"), dist.get_rank()
        where = f"backend={dist.get_backend()} world_size={dist.get_world_size()} fsdp={cfg.dp_shard} tp={cfg.tp}"
    inputs, labels = inputs.to(device), labels.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    if rank == 0:
        print(f"torchtitan llama3 debugmodel on {where} device={next(model.parameters()).device}", flush=True)
    global_tokens = cfg.batch_size * cfg.seq_len
    losses, grad_norms = [], []
    for step in range(1, cfg.steps + 1):
        logits = model(inputs)
        # torchtitan's loss: this rank's token SUM over the global token count; its FSDP sums gradients
        # (gradient_divide_factor=1), so the sum over ranks is the global mean's gradient
        loss = cross_entropy_loss(logits, labels, global_vocab_size=vocab_size) / global_tokens
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(list(model.parameters()), cfg.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(dist_utils.dist_sum(loss.detach(), loss_mesh) if loss_mesh is not None else loss.item())
        grad_norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f}", flush=True)
    return Result(losses, grad_norms, next(model.parameters()).device.type)


def train_pipeline(cfg: TitanConfig, llama3: types.ModuleType, device: torch.device) -> Result:
    """The training loop of torchtitan's Trainer under pipeline parallelism: the schedule runs forward
    and backward over the microbatches (the first stage feeds the tokens, the last one computes the
    loss), gradients are clipped over the pp mesh too, and the step's loss is the sum of the last
    stage's microbatch losses over the data-parallel ranks."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    if not dist.is_initialized():
        dist.init_process_group(cfg.backend)
    global_tokens = cfg.batch_size * cfg.seq_len
    vocab: list[int] = []  # known once the model is built; the loss runs only after that
    # each microbatch's token sum over the global token count; the schedule sums their gradients
    # (scale_grads=False), and FSDP2 sums over the dp ranks: the global mean's gradient
    schedule, parts, dims, vocab_size, has_first, has_last, stages = build_pipeline(
        cfg, llama3, device,
        lambda pred, labels: cross_entropy_loss(pred, labels, global_vocab_size=vocab[0]) / global_tokens)
    vocab.append(vocab_size)
    inputs, labels = (t.to(device) for t in batch(cfg, vocab_size, dims))
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.1)
    rank = dist.get_rank()
    tp_rank = dims.get_mesh("tp").get_local_rank() if cfg.tp > 1 else 0
    if rank == 0:
        print(f"torchtitan llama3 debugmodel on backend={dist.get_backend()} world_size={dist.get_world_size()} "
              f"pp={cfg.pp} ({cfg.pp_schedule}) fsdp={cfg.dp_shard} tp={cfg.tp} device={params[0].device}",
              flush=True)
    losses, grad_norms = [], []
    for step in range(1, cfg.steps + 1):
        microbatch_losses: list[torch.Tensor] = []
        schedule.step(*((inputs,) if has_first else ()), **({"target": labels, "losses": microbatch_losses}
                                                             if has_last else {}))
        grad_norm = dist_utils.clip_grad_norm_(params, cfg.max_norm, pp_mesh=dims.get_mesh("pp"))
        optimizer.step()
        optimizer.zero_grad()
        # the last stage's dp ranks hold the loss of their rows (the same on each of their tp ranks: one
        # adds it); every other rank adds zero
        loss = torch.stack(microbatch_losses).sum().detach() if has_last and tp_rank == 0 else \
            torch.zeros((), device=device)
        dist.all_reduce(loss)
        losses.append(loss.item())
        grad_norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f}", flush=True)
    return Result(losses, grad_norms, params[0].device.type, stages)


if __name__ == "__main__":
    main(sys.argv[1:])
