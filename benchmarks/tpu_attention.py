"""Pallas flash attention against XLA's attention on a TPU: forward and forward+backward times.

Run on a TPU machine (JAX with libtpu; torch not needed)::

    python benchmarks/tpu_attention.py                       # batch 8, 16 heads on 8 kv heads, bf16, causal
    python benchmarks/tpu_attention.py --seq 512 1024 --head-dim 64 --no-causal --dtype float32

For each shape it prints milliseconds (the best of 3 rounds of --iters pipelined calls) of
``tpudist.kernels.flash_attention`` and of XLA's attention as the library's reference computes it
(einsum, float32 softmax, einsum; k and v repeated for grouped-query attention; jitted), and the ratio
XLA / kernel (above 1: the kernel is faster). XLA's attention holds the float32 scores: shapes whose
scores would not fit in the chip's memory are reported, not run. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpudist.kernels import flash_attention as fa  # noqa: E402
from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu  # noqa: E402


def xla_attention(q, k, v, causal: bool):
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


def kernel_attention(q, k, v, causal: bool):
    return fa.flash_attention(q, k, v, causal=causal)


def forward_and_backward(attention, causal: bool):
    def run(q, k, v, grad):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, causal), q, k, v)
        return out, *pullback(grad)

    return jax.jit(run)


def milliseconds(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def memory_limit() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", 15.7 * 2**30))


def inputs(batch, heads, kv_heads, seq, head_dim, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim), (batch, kv_heads, seq, head_dim),
              (batch, heads, seq, head_dim)]
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(keys, shapes)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}; batch {args.batch}, heads "
          f"{args.heads} on {args.kv_heads} kv heads, {args.dtype}, causal={args.causal}; ms, XLA/kernel ratios")
    if device.platform != "tpu":
        print("not a TPU: the kernels run in interpret mode here, and the times mean nothing")
    limit = memory_limit()
    with pallas_interpret_unless_tpu():
        for head_dim in args.head_dim:
            for seq in args.seq:
                run_shape(args, seq, head_dim, limit)


def run_shape(args, seq: int, head_dim: int, limit: float) -> None:
    """One line: the kernel's and XLA's times for this sequence length and head dim."""
    q, k, v, grad = inputs(args.batch, args.heads, args.kv_heads, seq, head_dim, args.dtype)
    kernel_fwd = milliseconds(jax.jit(lambda q, k, v: kernel_attention(q, k, v, args.causal)), q, k, v,
                              iters=args.iters)
    kernel_both = milliseconds(forward_and_backward(kernel_attention, args.causal), q, k, v, grad, iters=args.iters)
    line = f"seq {seq:5d} head_dim {head_dim:3d}: kernel fwd {kernel_fwd:8.3f} fwd+bwd {kernel_both:8.3f} | XLA "
    scores = 3 * args.batch * args.heads * seq * seq * 4  # scores, probabilities and their gradient
    if scores > 0.8 * limit:
        print(line + f"not run: its float32 scores need ~{scores / 2**30:.1f} GiB of {limit / 2**30:.1f}", flush=True)
        return
    xla_fwd = milliseconds(jax.jit(lambda q, k, v: xla_attention(q, k, v, args.causal)), q, k, v, iters=args.iters)
    xla_both = milliseconds(forward_and_backward(xla_attention, args.causal), q, k, v, grad, iters=args.iters)
    print(line + f"fwd {xla_fwd:8.3f} fwd+bwd {xla_both:8.3f} | ratio fwd {xla_fwd / kernel_fwd:5.2f}x "
          f"fwd+bwd {xla_both / kernel_both:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
