"""Chip probe: the token embedding's backward at the benchmark's size, written four ways, timed and checked.

    python3 scripts/probes/embedding_backward.py [--tokens 8192 --vocab 32000 --dim 1024]   # pure JAX

``aten.embedding_dense_backward``'s lowering (``tpudist/ops/lowerings/indexing.py``) scatter-adds the
float32-upcast gradient rows into a float32 ``(vocab, dim)`` zero array, as torch's CPU kernel
accumulates; JAX's own gradient of ``weight[tokens]`` (the benchmark's twin) scatter-adds bfloat16 rows.
A scatter on a TPU can run far below the chip's bandwidth, so this times the alternatives on random
token ids:

- ``scatter f32``: the lowering as it is;
- ``scatter bf16``: the twin's (less accurate: bfloat16 sums);
- ``sorted scatter f32``: ids sorted first, the rows permuted with them, ``indices_are_sorted=True``;
- ``one-hot matmul``: ``one_hot(ids)^T @ grad`` on the MXU at ``Precision.HIGHEST`` with float32
  accumulation (exact for bfloat16 rows: each product is a row times 0 or 1).

Each result is compared with a float64 numpy sum, as the max relative error over the rows. Medians of
``--runs`` timed calls after a warm-up, each ended by ``block_until_ready``.
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--dim", type=int, default=1024)
p.add_argument("--runs", type=int, default=20)
a = p.parse_args()
print("device:", jax.devices()[0].device_kind, f"tokens {a.tokens} vocab {a.vocab} dim {a.dim}")

rng = np.random.default_rng(0)
ids_np = rng.integers(0, a.vocab, a.tokens).astype(np.int32)
grad_np = rng.standard_normal((a.tokens, a.dim)).astype(np.float32)
ids = jnp.asarray(ids_np)
grad = jnp.asarray(grad_np, jnp.bfloat16)
want = np.zeros((a.vocab, a.dim), np.float64)
np.add.at(want, ids_np, np.asarray(grad.astype(jnp.float32), np.float64))


def scatter_f32(ids, grad):
    return jnp.zeros((a.vocab, a.dim), jnp.float32).at[ids].add(grad.astype(jnp.float32))


def scatter_bf16(ids, grad):
    return jnp.zeros((a.vocab, a.dim), jnp.bfloat16).at[ids].add(grad)


def sorted_scatter_f32(ids, grad):
    order = jnp.argsort(ids)
    return jnp.zeros((a.vocab, a.dim), jnp.float32).at[ids[order]].add(
        grad[order].astype(jnp.float32), indices_are_sorted=True)


def one_hot_matmul(ids, grad):
    hot = jax.nn.one_hot(ids, a.vocab, dtype=grad.dtype)  # (tokens, vocab)
    return jax.lax.dot_general(hot, grad, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


scale = np.maximum(np.abs(want).max(axis=1, keepdims=True), 1e-30)
for name, fn in [("scatter f32", scatter_f32), ("scatter bf16", scatter_bf16),
                 ("sorted scatter f32", sorted_scatter_f32), ("one-hot matmul", one_hot_matmul)]:
    jitted = jax.jit(fn)
    out = jitted(ids, grad).block_until_ready()
    err = float((np.abs(np.asarray(out.astype(jnp.float32), np.float64) - want) / scale).max())
    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        jitted(ids, grad).block_until_ready()
        times.append(time.perf_counter() - t0)
    print(f"{name:<20} median {statistics.median(times) * 1e3:7.3f} ms  (min {min(times) * 1e3:7.3f})  "
          f"max rel error per row {err:.1e}")
