"""The tpudist command line: ``python -m tpudist <command> ...`` (or the ``tpudist`` script).

    python -m tpudist describe v5p:4x4x4 --mesh 4x16 --axes dp,tp --plot mesh.png
    python -m tpudist soak --ranks 4 --calls 5000 --seed 1
    python -m tpudist tpu-env --nproc-per-node 4 --json
    python -m tpudist warmup --dim 64 --heads 4 --seq-len 32 --batch 8 --dtype float32,bfloat16

Each command is a small function registered on its own subparser; add new ones (e.g. ``train``) the
same way. Nothing here imports torch at import time (``soak`` does, when it runs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _describe(args: argparse.Namespace) -> int:
    from tpudist.mesh import Topology, describe, plot_mesh

    topology = Topology.parse(args.topology)
    if args.axes and not args.mesh:
        raise _UsageError("--axes names mesh axes: pass --mesh too, e.g. --mesh 4x16 --axes dp,tp")
    if not args.mesh:
        if args.plot:
            raise _UsageError("--plot draws a mesh: pass --mesh too, e.g. --mesh 4x16")
        print(describe(topology))
        return 0
    layout = topology.mesh_layout(args.mesh, axis_names=args.axes,
                                  allow_split_physical_axes=args.allow_split)
    print(describe(layout))
    if args.plot:
        path = plot_mesh(topology, layout.mesh_shape, layout.axis_names, args.plot,
                         color_axis=args.color_axis,
                         allow_split_physical_axes=args.allow_split)
        print(f"wrote {path}")
    return 0


def _soak(args: argparse.Namespace) -> int:
    from tpudist.testing.soak import soak

    if min(args.ranks, args.calls, args.chunk, args.passes) < 1:
        raise _UsageError(f"--ranks={args.ranks}, --calls={args.calls}, --chunk={args.chunk} and "
                          f"--passes={args.passes} must be >= 1")
    print(f"soak: {args.calls} random collectives on {args.ranks} ranks, seed={args.seed}, "
          f"checked against {'gloo and ' if args.gloo else ''}a local reference", flush=True)
    mismatches = soak(args.ranks, args.calls, args.seed, chunk=args.chunk, passes=args.passes,
                      timeout=args.timeout, compare_gloo=args.gloo, out=lambda line: print(line, flush=True))
    return 1 if mismatches else 0


def _warmup(args: argparse.Namespace) -> int:
    import time

    import torch

    from tpudist.runtime.jax_cache import enable_persistent_cache
    from tpudist.kernels import library

    if min(args.batch, args.seq_len, args.dim, args.heads) < 1:
        raise _UsageError(f"--batch={args.batch}, --seq-len={args.seq_len}, --dim={args.dim} and "
                          f"--heads={args.heads} must be >= 1")
    dtypes = []
    for name in args.dtype.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise _UsageError(f"--dtype {name!r} is not a torch floating-point dtype (e.g. float32,bfloat16)")
        dtypes.append(dtype)
    path = enable_persistent_cache()
    if path is None:
        raise _UsageError("TPUDIST_CACHE_DIR=0 turns the persistent compile cache off: nothing to warm up")
    from jax import monitoring

    hits = []
    monitoring.register_event_listener(  # this process only runs the command
        lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    start = time.perf_counter()
    count = library.warmup(batch=args.batch, seq_len=args.seq_len, dim=args.dim, n_heads=args.heads,
                           dtypes=tuple(dtypes), eps=args.eps)
    print(f"warmup: {count} kernel programs ({', '.join(k.name for k in library.KERNELS)}; forward and "
          f"backward) in the cache {path}: {count - len(hits)} compiled, {len(hits)} already there "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def _tpu_env(args: argparse.Namespace) -> int:
    import json
    import os

    from tpudist.mesh import tpu_env
    from tpudist.mesh.tpu_facts import read_slice_facts

    port = tpu_env.base_port(os.environ) if args.base_port is None else args.base_port
    if not 0 < port < 65536 - args.nproc_per_node:
        raise _UsageError(f"--base-port={port} is not a port range start for {args.nproc_per_node} processes")
    plan = tpu_env.host_plan(read_slice_facts(os.environ), args.nproc_per_node, port, os.environ)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    print(f"slice {plan.slice}: {plan.slice.num_chips} chips, {plan.slice.num_hosts} host(s); "
          f"{len(plan.ranks)} process(es) on this host")
    for rank in plan.ranks:
        print(f"local rank {rank.local_rank}:")
        for name, value in rank.env:
            print(f"  {name}={value}{'   (already set: yours wins)' if name in rank.user_set else ''}")
    return 0


class _UsageError(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpudist", description="Run PyTorch distributed training on TPU slices.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    describe = commands.add_parser(
        "describe", help="describe a TPU slice and, optionally, a mesh laid onto it")
    describe.add_argument("topology", help="slice, e.g. v5p:4x4x4, v5e:2x4 or v5p:8 (chip count)")
    describe.add_argument("--mesh", help="mesh shape, least network-bound axis first, e.g. 4x16")
    describe.add_argument("--axes", help="mesh axis names, e.g. dp,tp")
    describe.add_argument("--allow-split", action="store_true",
                          help="let two mesh axes share a physical axis")
    describe.add_argument("--plot", metavar="PNG", help="also draw the mesh to this PNG")
    describe.add_argument("--color-axis", help="mesh axis that colours the plot (default: last)")
    describe.set_defaults(run=_describe)
    soak = commands.add_parser(
        "soak", help="run seeded random collectives on N emulated chips, checked bit for bit against gloo")
    soak.add_argument("--ranks", type=int, default=4, help="rank processes (emulated chips)")
    soak.add_argument("--calls", type=int, default=1000, help="collectives in the plan")
    soak.add_argument("--seed", type=int, default=0, help="seed of the plan (print it to replay a mismatch)")
    soak.add_argument("--chunk", type=int, default=500, help="calls per progress line")
    soak.add_argument("--passes", type=int, default=1,
                      help="run the plan this many times; passes after the first measure cached programs")
    soak.add_argument("--timeout", type=float, default=600.0,
                      help="seconds a chunk may take before every rank is killed")
    soak.add_argument("--gloo", action=argparse.BooleanOptionalAction, default=True,
                      help="also run every call on gloo (--no-gloo: the local reference only)")
    soak.set_defaults(run=_soak)
    tpu = commands.add_parser(
        "tpu-env", help="show libtpu's variables each local rank of this TPU host will set (one process per chip)")
    tpu.add_argument("--nproc-per-node", type=int, required=True, help="processes on this host (torchrun's)")
    tpu.add_argument("--base-port", type=int, default=None,
                     help="libtpu's first port (default TPUDIST_TPU_BASE_PORT or 8476); rank r uses base + r")
    tpu.add_argument("--json", action="store_true",
                     help='print {"slice": ..., "ranks": [{"local_rank": 0, "env": {...}}, ...]}')
    tpu.set_defaults(run=_tpu_env)
    warmup = commands.add_parser(
        "warmup", help="compile the kernel library (tpudist.kernels.library) into the persistent compile cache")
    warmup.add_argument("--batch", type=int, default=8, help="sequences per call")
    warmup.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    warmup.add_argument("--dim", type=int, default=64, help="model width")
    warmup.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = dim / heads)")
    warmup.add_argument("--eps", type=float, default=1e-5, help="RMSNorm epsilon (a static argument)")
    warmup.add_argument("--dtype", default="float32", help="comma-separated dtypes, e.g. float32,bfloat16")
    warmup.set_defaults(run=_warmup)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status (2 for bad input, with the reason on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, ImportError) as exc:  # TopologyError is a ValueError
        print(f"tpudist {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
