"""Probe for the TPU chip: torch's float32 matmul precision through tpudist, measured (issue #37 item 1).

    python scripts/probes/matmul_precision.py [--size 4096] [--reps 20] [--seq 1024]

For each torch.set_float32_matmul_precision ("highest", "high", "medium") it prints:
- a float32 size^3 matmul on the "tpu" device (Fused mode, a chain of ``reps`` per sync) and through
  torch.compile(backend="tpu"): ms per matmul, TFLOP/s, relative (Frobenius) error from float64;
- bf16 SDPA forward + backward (batch 8, 16 heads, ``seq`` tokens, head dim 64, causal) on the device and
  compiled: ms per step. On the device bf16 attention multiplies bf16 operands (one MXU pass at any
  setting); compiled, torch's MATH decomposition upcasts to float32, so it follows the setting;
- the host cost of recording an add and an mm in Fused mode (us per op, thread CPU time).
Runs anywhere (CPU numbers say nothing about the chip).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401

SETTINGS = ("highest", "high", "medium")


def _timed(step, repeats: int = 5) -> float:
    """Median seconds of ``step()`` (which must wait for its results), after one warm-up call."""
    step()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _chain(x, w, reps: int):
    for _ in range(reps):
        x = x @ w
    return x


def matmuls(size: int, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g) / size ** 0.5
    exact = x.double() @ w.double()
    dx, dw = x.to("tpu"), w.to("tpu")
    compiled = torch.compile(_chain, backend="tpu", dynamic=False)
    flops = 2 * size ** 3 * reps
    print(f"float32 {size}^3 matmul, {reps} chained per program")
    for setting in SETTINGS:
        torch.set_float32_matmul_precision(setting)
        error = float(((dx @ dw).cpu().double() - exact).norm() / exact.norm())
        eager = _timed(lambda: _sync(_chain(dx, dw, reps)))
        graph = _timed(lambda: _sync(compiled(dx, dw, reps)))
        print(f"  {setting:8s} error {error:.2e}   fused {eager / reps * 1e3:7.3f} ms ({flops / eager / 1e12:6.1f} "
              f"TFLOP/s)   compiled {graph / reps * 1e3:7.3f} ms ({flops / graph / 1e12:6.1f} TFLOP/s)")


def _sync(t: torch.Tensor) -> torch.Tensor:
    torch.tpu.synchronize()
    t.view(-1)[:1].cpu()  # the program ran: its result is read
    return t


def attention(seq: int) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 16, seq, 64, generator=g).to(torch.bfloat16).to("tpu").requires_grad_()
               for _ in range(3))
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             backend="tpu", dynamic=False)

    def step(fn):
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).float().square().sum().backward()
        _sync(q.grad)

    print(f"bf16 SDPA forward + backward, B8 H16 T{seq} D64, causal")
    for setting in SETTINGS:
        torch.set_float32_matmul_precision(setting)
        eager = _timed(lambda: step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        graph = _timed(lambda: step(compiled))
        print(f"  {setting:8s} fused {eager * 1e3:8.2f} ms   compiled {graph * 1e3:8.2f} ms")


def recording_cost(n: int = 500) -> None:
    x = torch.randn(8, 8).to("tpu")
    print("Fused recording, host CPU per op (median of 15 runs of", n, "ops)")
    for name, fn in (("add", lambda: x + x), ("mm", lambda: x @ x)):
        samples = []
        for i in range(18):
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            spent = time.thread_time() - t0
            torch.tpu.synchronize()
            if i >= 3:
                samples.append(spent / n * 1e6)
        print(f"  {name}: {statistics.median(samples):.2f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seq", type=int, default=1024)
    a = p.parse_args()
    torch.tpu.set_eager_mode("fused")
    try:
        matmuls(a.size, a.reps)
        attention(a.seq)
        recording_cost()
    finally:
        torch.set_float32_matmul_precision("highest")


if __name__ == "__main__":
    main()
