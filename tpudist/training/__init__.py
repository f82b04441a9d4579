"""Reusable training parts for the recipes: a Llama-style model, a typed config, the trainer loop,
distributed checkpoints, metrics and a TPU shape advisor.

    from tpudist.training import TrainConfig, Trainer, parse_config
    Trainer(parse_config(TrainConfig)).train()     # under torchrun: FSDP2 on the "tpu" backend
"""

from tpudist.training.advisor import Advice, advise
from tpudist.training.checkpoint import Checkpointer
from tpudist.training.config import TrainConfig, option, parse_config
from tpudist.training.data import MarkovTask
from tpudist.training.metrics import MetricsLogger, StepMetrics
from tpudist.training.model import ModelArgs, Transformer
from tpudist.training.parallelize import ParallelDims, build_mesh, parallelize
from tpudist.training.trainer import Trainer, clip_grad_norm_, run

__all__ = [
    "Advice", "Checkpointer", "MarkovTask", "MetricsLogger", "ModelArgs", "ParallelDims", "StepMetrics",
    "TrainConfig", "Trainer", "Transformer", "advise", "build_mesh", "clip_grad_norm_", "option",
    "parallelize", "parse_config", "run",
]
