"""Rank-side function of tests/device/test_device_trainer_ddp.py: Hugging Face ``Trainer`` as a user
launches it with ``torchrun`` (the pool's ranks have torchrun's environment and no process group:
accelerate makes the group, as in a user's script)."""

from __future__ import annotations

import tempfile

import torch


def tiny_llama_config_and_data(rows: int):
    """A tiny Llama config (tied embeddings) and ``rows`` causal-LM samples of 16 tokens, the same every call."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=generator)} for _ in range(rows)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    return cfg, data


def train_tiny_llama(use_cpu: bool, steps: int = 2, fsdp_config: dict | None = None) -> dict:
    """Trains a tiny Llama with ``Trainer`` on this rank (SGD: AdamW's first steps divide each gradient
    by its own size, which turns float noise in a near-zero gradient into a visible weight difference).
    With ``fsdp_config``, ``TrainingArguments(fsdp="full_shard", fsdp_config=fsdp_config)``."""
    import tpudist.device  # noqa: F401  (before any backward: torch's autograd engine sizes its queues then)
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    cfg, data = tiny_llama_config_and_data(16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    fsdp_args = {} if fsdp_config is None else {"fsdp": "full_shard", "fsdp_config": fsdp_config}
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, learning_rate=0.1,
                                 optim="sgd", report_to=[], use_cpu=use_cpu, logging_steps=1, save_strategy="no",
                                 seed=0, disable_tqdm=True, **fsdp_args)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    wrapped = trainer.model_wrapped
    return {
        "backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(args.device),
        "parallel_mode": str(args.parallel_mode), "wrapped": type(wrapped).__name__,
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        "param_device": str(next(model.parameters()).device),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": {k: _full(v).detach().cpu() for k, v in model.state_dict().items()},
        "placements": {k: _placement(v) for k, v in model.named_parameters()},
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _placement(tensor: torch.Tensor) -> tuple | None:
    """(placements, mesh device type, mesh group backend, local shape) of a DTensor parameter; None for a plain one."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    return (tuple(str(p) for p in tensor.placements), mesh.device_type, dist.get_backend(mesh.get_group()),
            tuple(tensor.to_local().shape), str(tensor.to_local().device))


def accelerate_fsdp_from_env() -> dict:
    """``ACCELERATE_USE_FSDP=true`` with ``FSDP_VERSION`` 1 (accelerate's default), then 2, on the device:
    version 1 must raise, version 2 must shard a Linear's weight with ``fully_shard`` on the "tpu" group."""
    import os

    import tpudist.device  # noqa: F401
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    os.environ["ACCELERATE_USE_FSDP"] = "true"
    try:
        Accelerator()
        error = None
    except NotImplementedError as exc:
        error = str(exc)
    AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001 - accelerate's own test reset
    os.environ["FSDP_VERSION"] = "2"
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)))
    return {"error_v1": error, "distributed_type": str(accelerator.distributed_type),
            "placements": {k: _placement(v) for k, v in model.named_parameters()}}
