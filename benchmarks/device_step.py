"""Step time of the Llama-style model on the "tpu" device in each eager mode, against CPU eager torch.

    python benchmarks/device_step.py                       # defaults: dim 64, 2 layers, B2 T64
    python benchmarks/device_step.py --dim 128 --seq 128 --batch 4 --steps 20

One process holds four identical models (CPU eager, Debug, Strict, Fused); each round runs one
training step (forward, backward, AdamW, ``loss.item()``) of each, in a rotating order, so machine
noise hits all alike. Printed: median step times and their ratios, the Strict per-op overhead
(a 64x64 add through the device minus the same add as a bare ``jax.jit`` call), Fused recording cost
per op, the graph-key cost per sync as a share of the step, and compile times of the Fused step with
a cold and a warm persistent cache (two fresh child processes sharing a new cache directory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # CPU eager shares 2 cores with XLA: one thread each

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step per mode each)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--skip-compile", action="store_true", help="skip the cold/warm compile measurement")
    return p.parse_args(argv)


def _model(a):
    from tpudist.training.model import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=4, n_kv_heads=2,
                                 max_seq_len=a.seq))


def _step(model, opt, x, y, device, mode):
    import tpudist.device  # noqa: F401

    t0 = time.perf_counter()
    ctx = torch.tpu.eager_mode(mode) if mode else _null()
    with ctx:
        loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
    return time.perf_counter() - t0, value


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _batch(a, g):
    return (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
            torch.randint(0, a.vocab, (a.batch, a.seq), generator=g))


def compile_only(a) -> dict:
    """Child process: the first two Fused steps; how long their programs took to compile."""
    import tpudist.device  # noqa: F401

    model = _model(a).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(2):
        _step(model, opt, *_batch(a, g), "tpu", "fused")
    stats = torch.tpu.cache_stats()
    return {"first_two_steps_s": time.perf_counter() - t0, "compile_s": stats["compile_s"],
            "programs": stats["programs"]}


def _compile_cold_warm(a) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TPUDIST_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--compile-only", "--dim", str(a.dim), "--layers", str(a.layers),
               "--seq", str(a.seq), "--batch", str(a.batch), "--vocab", str(a.vocab)]
        out = []
        for _ in range(2):
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if run.returncode:
                raise RuntimeError(run.stderr)
            out.append(json.loads(run.stdout.strip().splitlines()[-1]))
        return out[0], out[1]


def per_op_costs() -> dict:
    import jax

    import tpudist.device  # noqa: F401
    from tpudist.device import _core, _fused

    x, y = torch.randn(64, 64, device="tpu"), torch.randn(64, 64, device="tpu")
    bare = jax.jit(lambda u, v: u + v)
    ax, ay = _core.buffer_of(x).value.reshape(64, 64), _core.buffer_of(y).value.reshape(64, 64)
    xc, yc = x.cpu(), y.cpu()
    n = 1000
    results = {}
    for _ in range(3):  # interleaved repeats; medians below
        for label, fn in (("bare_jit_us", lambda: bare(ax, ay)), ("cpu_torch_us", lambda: xc + yc)):
            fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            jax.block_until_ready(bare(ax, ay))
            results.setdefault(label, []).append((time.perf_counter() - t0) / n * 1e6)
        for mode in ("strict", "debug", "fused"):
            with torch.tpu.eager_mode(mode):
                z = x + y
                torch.tpu.synchronize()
                t0 = time.perf_counter()
                for _ in range(n // 10 if mode == "fused" else n):
                    z = x + y
                    if mode == "fused" and _fused.pending_ops() >= 100:
                        break
                elapsed = time.perf_counter() - t0
                count = _fused.pending_ops() if mode == "fused" else n
                results.setdefault(f"{mode}_us", []).append(elapsed / count * 1e6)
            del z
            torch.tpu.synchronize()
    med = {k: statistics.median(v) for k, v in results.items()}
    med["strict_overhead_us"] = med["strict_us"] - med["bare_jit_us"]
    return med


def main(argv=None) -> None:
    a = _args(argv)
    if a.compile_only:
        print(json.dumps(compile_only(a)))
        return
    import tpudist.device  # noqa: F401

    base = _model(a)
    runs = {"cpu": (base, None, "cpu")}
    for mode in ("debug", "strict", "fused"):
        runs[mode] = (copy.deepcopy(base).to("tpu"), mode, "tpu")
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, (m, _, _) in runs.items()}
    g = torch.Generator().manual_seed(0)
    batches = [_batch(a, g) for _ in range(a.steps + 2)]
    first = {}
    for name, (m, mode, device) in runs.items():  # two warm-up steps each (compiles)
        first[name] = sum(_step(m, opts[name], *batches[i], device, mode)[0] for i in range(2))
    before = torch.tpu.cache_stats()
    times = {k: [] for k in runs}
    names = list(runs)
    for r in range(a.steps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            m, mode, device = runs[name]
            times[name].append(_step(m, opts[name], *batches[2 + r], device, mode)[0])
    after = torch.tpu.cache_stats()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    syncs = after["syncs"] - before["syncs"]
    key_ms = (after["graph_key_s"] - before["graph_key_s"]) / max(syncs, 1) * 1e3
    print(f"model dim={a.dim} layers={a.layers} batch={a.batch} seq={a.seq}; {a.steps} interleaved rounds")
    print("median step ms: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print("ratios vs cpu eager: " + ", ".join(f"{k} {med[k] / med['cpu']:.2f}x" for k in ("debug", "strict", "fused")))
    print(f"fused speed-up over strict: {med['strict'] / med['fused']:.2f}x; over debug: {med['debug'] / med['fused']:.2f}x")
    print(f"new programs/kernels during timed rounds: programs {after['programs'] - before['programs']}, "
          f"kernels {after['kernels'] - before['kernels']}")
    ops_per_step = (after["fused_ops"] - before["fused_ops"]) / a.steps
    print(f"fused: {ops_per_step:.0f} ops/step, {syncs / a.steps:.1f} syncs/step, graph key {key_ms * 1e3:.0f} us/sync "
          f"= {key_ms * syncs / a.steps / med['fused'] * 100:.2f}% of a fused step")
    print("first two steps (compile, this process): " + ", ".join(f"{k} {v:.2f}s" for k, v in first.items()))
    costs = per_op_costs()
    print("per-op (64x64 add, median of 3): " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    if not a.skip_compile:
        cold, warm = _compile_cold_warm(a)
        print(f"fused first two steps in a fresh process: cold cache {cold['first_two_steps_s']:.2f}s "
              f"(compile {cold['compile_s']:.2f}s, {cold['programs']} programs), warm cache "
              f"{warm['first_two_steps_s']:.2f}s (compile {warm['compile_s']:.2f}s): "
              f"{cold['compile_s'] / max(warm['compile_s'], 1e-9):.1f}x faster compile")


if __name__ == "__main__":
    main()
