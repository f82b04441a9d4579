"""Pallas flash attention against XLA's attention on a TPU: forward and forward+backward times.

Run on a TPU machine (JAX with libtpu; torch not needed)::

    python benchmarks/tpu_attention.py                       # batch 8, 16 heads on 8 kv heads, bf16, causal
    python benchmarks/tpu_attention.py --seq 512 1024 --head-dim 64 --no-causal --dtype float32

For each shape it prints milliseconds (the best of 3 rounds of --iters pipelined calls) of
``tpudist.kernels.flash_attention`` and of XLA's attention as the library's reference computes it
(einsum, float32 softmax, einsum; k and v repeated for grouped-query attention; jitted), and the ratio
XLA / kernel (above 1: the kernel is faster). XLA's attention holds the float32 scores: shapes whose
scores would not fit in the chip's memory are reported, not run. Prints, never asserts.

Where the kernel stands against other kernels of the same shapes (its forward's TFLOP/s: the causal
``2 * 2 * batch * heads * seq^2 * head_dim / 2``)::

    python benchmarks/tpu_attention.py --seq 1024 --head-dim 64 --blocks 256x512 512x512 1024x512 --jax-kernels

``--blocks QxK ...`` times the kernel at each ``(block_q, block_k)`` (forward and backward alike) besides its
defaults; ``--jax-kernels`` times JAX's own TPU kernels (``jax.experimental.pallas.ops.tpu``: flash
attention, and splash attention with a causal mask), each on k and v repeated to the query heads, with
their default block sizes. Those need a TPU (Mosaic); elsewhere they are left out.
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


def _repeated(k, v, heads):
    """k and v repeated to ``heads`` heads (grouped-query attention as the non-grouped kernels take it)."""
    group = heads // k.shape[1]
    return jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)


def xla_attention(q, k, v, causal: bool):
    k, v = _repeated(k, v, q.shape[1])
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


def kernel_attention(q, k, v, causal: bool, blocks=(None, None)):
    return fa.flash_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1])


def jax_flash_attention(q, k, v, causal: bool):
    """JAX's Pallas TPU flash attention (``jax.experimental.pallas.ops.tpu.flash_attention``), default blocks."""
    from jax.experimental.pallas.ops.tpu import flash_attention as jfa

    k, v = _repeated(k, v, q.shape[1])
    return jfa.flash_attention(q, k, v, causal=causal, sm_scale=1 / math.sqrt(q.shape[-1]))


def jax_splash_attention(causal: bool, heads: int, seq: int):
    """JAX's splash attention (``...ops.tpu.splash_attention``) for one shape: a causal (or full) mask per head,
    vmapped over the batch, default blocks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one = sm.CausalMask((seq, seq)) if causal else sm.FullMask((seq, seq))
    kernel = sk.make_splash_mha_single_device(sm.MultiHeadMask([one] * heads))

    def attention(q, k, v, causal_unused):
        k, v = _repeated(k, v, q.shape[1])
        return jax.vmap(kernel)(q / math.sqrt(q.shape[-1]), k, v)

    return attention


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
    parser.add_argument("--blocks", nargs="*", default=[], metavar="QxK",
                        help="also time the kernel at these (block_q, block_k), e.g. 256x512 1024x512")
    parser.add_argument("--jax-kernels", action="store_true",
                        help="also time JAX's own TPU flash and splash attention (on a TPU only)")
    args = parser.parse_args(argv)
    try:
        args.blocks = [tuple(int(n) for n in b.lower().split("x")) for b in args.blocks]
    except ValueError:
        parser.error(f"--blocks takes QxK pairs such as 512x512, not {args.blocks}")
    if any(len(b) != 2 for b in args.blocks):
        parser.error(f"--blocks takes QxK pairs such as 512x512, not {args.blocks}")
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
    others = [(f"kernel {bq}x{bk}", lambda q, k, v, c, b=(bq, bk): kernel_attention(q, k, v, c, b))
              for bq, bk in args.blocks]
    if args.jax_kernels and jax.devices()[0].platform == "tpu":
        others += [("jax flash", jax_flash_attention),
                   ("jax splash", jax_splash_attention(args.causal, args.heads, seq))]
    flops = 4 * args.batch * args.heads * seq * seq * head_dim * (0.5 if args.causal else 1.0)
    for name, attention in [("kernel", kernel_attention), *others]:
        try:
            if name == "kernel":
                fwd, both = kernel_fwd, kernel_both
            else:
                fwd = milliseconds(jax.jit(lambda q, k, v, a=attention: a(q, k, v, args.causal)), q, k, v,
                                   iters=args.iters)
                both = milliseconds(forward_and_backward(attention, args.causal), q, k, v, grad, iters=args.iters)
        except Exception as e:  # noqa: BLE001 - a block size or kernel that does not compile is reported
            print(f"    {name:<18} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"    {name:<18} fwd {fwd:8.3f} ms ({flops / fwd / 1e9:6.1f} TFLOP/s)  fwd+bwd {both:8.3f} ms  "
              f"kernel/this fwd {kernel_fwd / fwd:5.2f}x fwd+bwd {kernel_both / both:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
