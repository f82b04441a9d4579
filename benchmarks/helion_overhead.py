"""Per-call cost of a Helion kernel through tpudist vs Helion's own launcher vs a custom_jax_kernel.

    python benchmarks/helion_overhead.py                      # elementwise add of 4096 floats
    python benchmarks/helion_overhead.py --n 65536 --rounds 20 --iters 50

One Helion Pallas kernel (``add``, Pallas interpret mode on CPU) and one ``custom_jax_kernel`` doing
the same in jnp, each mode a call plus waiting for its result, interleaved round by round in one
process so machine noise hits them alike (best round and median round printed):
  helion tpu (tpudist)      plain ``add(x, y)`` on "tpu" tensors, Strict mode: routed to the arrays
  helion tpu (launcher)     the same call through Helion's own launcher (host copy in, copy back)
  helion cpu (launcher)     Helion's own launcher on CPU tensors (the reference cost)
  helion cpu (tpudist op)   the kernel's tpudist op on CPU tensors (zero-copy host views)
  helion bare jit           the kernel's JAX program under jax.jit on jax.Arrays (no torch at all)
  jax kernel tpu / cpu      ``custom_jax_kernel`` with ``x + y`` on "tpu" / CPU tensors
Ratios are against "helion cpu (launcher)". Measured, not asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import helion  # noqa: E402
import helion.language as hl  # noqa: E402
import torch  # noqa: E402
from kernel_overhead import _per_call  # noqa: E402  (this folder is on sys.path when run as a script)


@helion.kernel(backend="pallas", pallas_interpret=True, config=helion.Config(block_sizes=[1024]))
def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # module level: Helion refuses closures
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] + y[tile]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode, interleaved")
    parser.add_argument("--iters", type=int, default=50, help="calls per round (tpudist and jax modes)")
    parser.add_argument("--launcher-iters", type=int, default=2,
                        help="calls per round through Helion's launcher (~0.4 s each on this machine)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import tpudist.device  # noqa: F401
    from tpudist.kernels import custom_jax_kernel
    from tpudist.kernels.helion import as_op

    @custom_jax_kernel("helion_bench::jnp_add")
    def jnp_add(x, y):
        return x + y

    helion_launcher = type(add).__call__.__wrapped__  # Helion's own __call__, before tpudist's route
    x, y = torch.randn(args.n), torch.randn(args.n)
    xt, yt = x.to("tpu"), y.to("tpu")
    op = as_op(add)
    bare = jax.jit(op.traced({}))
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    sync = torch.tpu.synchronize
    torch.tpu.set_eager_mode("strict")
    modes = {
        "helion cpu (launcher)": lambda: add(x, y),
        "helion tpu (tpudist)": lambda: (add(xt, yt), sync()),
        "helion tpu (launcher)": lambda: (helion_launcher(add, xt, yt), sync()),
        "helion cpu (tpudist op)": lambda: op(x, y),
        "helion bare jit": lambda: torch.from_dlpack(bare(xj, yj).block_until_ready()),
        "jax kernel tpu": lambda: (jnp_add(xt, yt), sync()),
        "jax kernel cpu": lambda: jnp_add(x, y),
    }
    want = x + y
    for name, fn in modes.items():  # compile, warm up, and check each mode computes the sum
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out.cpu(), want, msg=lambda m, name=name: f"{name}: {m}")
        _per_call(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in modes}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in modes.items():
                gc.collect()  # Helion's eager launcher leaves garbage whose collection would hit the next mode
                times[name].append(_per_call(fn, args.launcher_iters if "launcher" in name else args.iters))
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    best = {name: min(t) * 1e6 for name, t in times.items()}
    ref, jax_ref = "helion cpu (launcher)", "jax kernel tpu"
    print(f"Helion add of {args.n} float32, {args.rounds} rounds x {args.iters} calls ({args.launcher_iters} "
          f"through Helion's launcher), us per call (best round; median); ratios to {ref!r} and {jax_ref!r}:")
    for name in modes:
        print(f"  {name:24s} best {best[name]:10.1f} us {best[name] / best[ref]:8.4f}x "
              f"{best[name] / best[jax_ref]:8.1f}x   median {med[name]:10.1f} us {med[name] / med[ref]:8.4f}x {med[name] / med[jax_ref]:8.1f}x")


if __name__ == "__main__":
    main()
