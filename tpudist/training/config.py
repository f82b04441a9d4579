"""Typed training configuration with a command line generated from its fields.

Each field of a config dataclass is declared with :func:`option`, which carries its help text; the
parser takes one ``--field-name`` flag per field (booleans get ``--flag/--no-flag``, tuples of ints
are written ``1,2,2``), so a recipe's options, defaults and documentation live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Sequence, TypeVar

from tpudist.training.model import ModelArgs

Config = TypeVar("Config")


def option(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with a default, the help text shown by ``--help`` and optional allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints, e.g. 1,2,2") from None


def build_parser(config_cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with one flag per field of ``config_cls``, defaults from the class."""
    parser = argparse.ArgumentParser(description=description or config_cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        help_text = field.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=field.default, help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=field.name, type=_int_tuple, default=field.default,
                                metavar="N,N,...", help=help_text)
        elif kind in (int, float, str):
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default, help=help_text,
                                choices=field.metadata.get("choices"))
        else:
            raise TypeError(f"config field {field.name}: {kind} has no command-line form; "
                            "use bool, int, float, str or tuple[int, ...]")
    return parser


def parse_config(config_cls: type[Config], argv: Sequence[str] | None = None) -> Config:
    """``config_cls`` built from the defaults overridden by ``argv`` (``sys.argv[1:]`` if None).

    Example:
        >>> from tpudist.training import TrainConfig
        >>> parse_config(TrainConfig, ["--steps", "5", "--mesh", "1,2,2"]).mesh
        (1, 2, 2)
    """
    namespace = build_parser(config_cls).parse_args(argv)
    return config_cls(**vars(namespace))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Train a Llama-style decoder on a synthetic Markov-chain language task."""

    # model
    vocab_size: int = option(128, "vocabulary size (the advisor asks for a multiple of 128)")
    dim: int = option(64, "model width")
    n_layers: int = option(2, "number of transformer blocks")
    n_heads: int = option(4, "attention heads (must be divisible by the tp degree)")
    n_kv_heads: int = option(2, "key/value heads of grouped-query attention (divisible by tp)")
    ffn_hidden: int = option(0, "SwiGLU hidden width; 0 picks ~8/3*dim rounded up to 16")
    kernels: str = option("torch", "torch: RMSNorm and attention as torch ops; jax: as tpudist.kernels.library "
                                   "JAX kernels (same results)", ("torch", "jax"))
    # device
    device: str = option("auto", "where the model computes: tpu (the tpudist \"tpu\" device, every op an XLA "
                                 "program), cpu (torch CPU eager; only collectives go through XLA), or auto "
                                 "(tpu on real TPU chips, cpu when chips are emulated by CPU processes)",
                         ("auto", "cpu", "tpu"))
    eager_mode: str = option("fused", "--device tpu: debug (each op run and checked at once), strict (each op "
                                      "its own cached program) or fused (a step's ops fused into one cached "
                                      "program at each sync point)", ("debug", "strict", "fused"))
    # data
    seq_len: int = option(32, "tokens per sequence")
    global_batch: int = option(16, "sequences per step over all data-parallel ranks")
    data_seed: int = option(0, "seed of the Markov transition table and of every step's batch")
    branching: int = option(4, "likely successors per token in the Markov chain (loss floor ~ln of it)")
    variable_length: bool = option(False, "each step's sequences have a length between seq_len/8 and seq_len, "
                                          "padded on the right to a bucket (targets -100 on padding)")
    bucket_multiple: int = option(128, "--variable-length: bucket sizes are multiples of this (at most 8 "
                                       "buckets up to seq_len; 128 fills TPU tiles)")
    # optimisation
    steps: int = option(150, "total optimizer steps (a resumed run stops at the same step)")
    lr: float = option(1e-2, "peak AdamW learning rate")
    warmup_steps: int = option(10, "linear warm-up steps before cosine decay to 10% of lr")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float = option(1.0, "clip the global gradient norm to this; 0 disables")
    seed: int = option(0, "seed of the parameter initialisation (identical on every rank)")
    # parallelism
    backend: str = option("tpu", "process group backend when torchrun started the ranks", ("tpu", "gloo"))
    parallelism: str = option("fsdp", "fsdp (FSDP2 fully_shard, HSDP and TP from --mesh) or ddp", ("fsdp", "ddp"))
    mesh: tuple[int, ...] = option((), "dp_replicate,dp_shard,tp sizes, e.g. 1,2,2; empty: 1,world,1")
    param_dtype: str = option("float32", "FSDP2 compute dtype (gradients are reduced in float32)",
                              ("float32", "bfloat16"))
    reshard_after_forward: bool = option(True, "FSDP2: free gathered parameters after each forward")
    activation_checkpoint: bool = option(False, "recompute each block's activations in backward")
    compile: bool = option(False, "torch.compile each block's forward (one XLA program per block forward "
                                  "and backward with --compile-backend tpu)")
    compile_backend: str = option("tpu", "Dynamo backend of --compile (tpu, tpudist, inductor, ...)")
    # output
    log_every: int = option(1, "print a progress line every this many steps (rank 0)")
    metrics_path: str = option("", "append one JSON line of metrics per step here (rank 0); empty: off")
    checkpoint_dir: str = option("", "distributed checkpoints go here; empty: no checkpoints")
    checkpoint_every: int = option(50, "save a checkpoint every this many steps (and at the end)")
    resume: bool = option(False, "continue from the last complete checkpoint in --checkpoint-dir")
    stop_after: int = option(0, "stop after this step as if preempted (no final checkpoint); 0: run to --steps")
    tpu_generation: str = option("", "TPU generation the advisor checks shapes for (v5e, v6e, ...); "
                                     "empty: from TPUDIST_TOPOLOGY, else v5e")

    def __post_init__(self) -> None:
        if self.parallelism not in ("fsdp", "ddp"):
            raise ValueError(f"parallelism={self.parallelism!r} must be 'fsdp' or 'ddp'")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"param_dtype={self.param_dtype!r} must be 'float32' or 'bfloat16'")
        if self.mesh and len(self.mesh) != 3:
            raise ValueError(f"mesh={self.mesh} must have 3 sizes: dp_replicate,dp_shard,tp (e.g. 1,2,2)")
        if self.device not in ("auto", "cpu", "tpu"):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu' or 'tpu'")
        if self.eager_mode not in ("debug", "strict", "fused"):
            raise ValueError(f"eager_mode={self.eager_mode!r} must be 'debug', 'strict' or 'fused'")
        if self.bucket_multiple < 1:
            raise ValueError(f"bucket_multiple={self.bucket_multiple} must be >= 1")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs checkpoint_dir: pass --checkpoint-dir DIR")

    def model_args(self) -> ModelArgs:
        """The decoder shape these options describe (``max_seq_len``: ``seq_len``, or the largest bucket)."""
        max_seq_len = self.buckets().sizes[-1] if self.variable_length else self.seq_len
        return ModelArgs(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden, max_seq_len=max_seq_len,
                         kernels=self.kernels)

    def buckets(self):
        """The ``tpudist.device.buckets.Buckets`` that ``--variable-length`` pads to."""
        return load_buckets().Buckets(self.seq_len, multiple=self.bucket_multiple)


def load_buckets():
    """``tpudist.device.buckets``, without installing the "tpu" device when it is not installed yet.

    Importing any ``tpudist.device`` submodule runs the package's ``__init__``, which renames torch's
    PrivateUse1 backend for the whole process (the device opt-in). ``buckets.py`` is plain torch, so a
    ``--device cpu`` run loads it as a standalone module and stays opted out.
    """
    import importlib.util
    import sys

    if "tpudist.device" in sys.modules:
        from tpudist.device import buckets

        return buckets
    module = sys.modules.get("_tpudist_buckets")
    if module is None:
        spec = importlib.util.find_spec("tpudist")
        path = next(iter(spec.submodule_search_locations)) + "/device/buckets.py"
        spec = importlib.util.spec_from_file_location("_tpudist_buckets", path)
        module = sys.modules["_tpudist_buckets"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # dataclasses look their module up in sys.modules
    return module
