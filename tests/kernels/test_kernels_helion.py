"""Helion kernels through tpudist (``tpudist.kernels.helion``): CPU tensors, compiled graphs, the "tpu"
device in Debug/Strict/Fused modes, DTensors.

The reference is Helion itself on CPU tensors (its own launcher, Pallas interpret mode), and torch.
Every check on the tpudist path runs with Helion's host conversion (``launcher._torch_to_jax`` /
``_jax_to_torch``) replaced by a function that raises, so taking that path fails the test; one test
shows the patch catches Helion's own path. Device cases run in a worker process (installing the
device renames PrivateUse1 process-wide); DTensor cases in two "tpu" ranks. No matmul: Helion 1.5.1's
own Pallas-interpret matmul fails on jax 0.10.2 ("Did not ask for inval to be discharged").
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

helion = pytest.importorskip("helion", reason="Helion kernels need Helion: pip install -e '.[helion]'")
hl = pytest.importorskip("helion.language")

from tpudist.kernels import KernelGradientError  # noqa: E402
from tpudist.kernels.helion import as_op, helion_op  # noqa: E402
from tpudist.testing import RankPool  # noqa: E402

TOL = 1e-6
PALLAS = {"backend": "pallas", "pallas_interpret": True}  # Helion's own CPU path needs interpret mode


# -- kernels (defined at import: the worker processes import this module too) -------------------------
@helion.kernel(config=helion.Config(block_sizes=[16]), **PALLAS)
def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] + y[tile]
    return out


@helion.kernel(config=helion.Config(block_sizes=[2]), **PALLAS)
def row_softmax(x: torch.Tensor) -> torch.Tensor:
    n, _m = x.size()
    out = torch.empty_like(x)
    for tile_n in hl.tile(n):
        out[tile_n, :] = torch.nn.functional.softmax(x[tile_n, :], dim=1)
    return out


@helion.kernel(config=helion.Config(block_sizes=[16]), **PALLAS)
def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] * alpha
    return out


@helion.kernel(config=helion.Config(block_sizes=[16]), **PALLAS)
def mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] * y[tile]
    return out


@helion.kernel(config=helion.Config(block_sizes=[16]), **PALLAS)
def mul_backward(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gx, gy = torch.empty_like(x), torch.empty_like(y)
    for tile in hl.tile(x.size()):
        gx[tile] = g[tile] * y[tile]
        gy[tile] = g[tile] * x[tile]
    return gx, gy


# Ops with gradients: a Helion backward kernel, a torch reference, a JAX backward with a scalar.
mul_op = helion_op("helion_test::mul", backward=mul_backward, shard_dims="..., ... -> ...")(mul)
softmax_op = helion_op("helion_test::row_softmax", torch_reference=lambda x: torch.softmax(x, -1),
                       shard_dims="... _ -> ... _")(row_softmax)
scale_op = helion_op("helion_test::scale", backward=lambda x, g, *, alpha: (g * alpha,))(scale)


@contextlib.contextmanager
def no_host_conversion():
    """Helion's torch<->JAX conversion raises inside (the copies tpudist must never make)."""
    from helion.runtime.pallas import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("Helion's host conversion (launcher._torch_to_jax/_jax_to_torch) was taken")

    saved = launcher._torch_to_jax, launcher._jax_to_torch  # noqa: SLF001
    launcher._torch_to_jax = launcher._jax_to_torch = refuse  # noqa: SLF001
    try:
        yield
    finally:
        launcher._torch_to_jax, launcher._jax_to_torch = saved  # noqa: SLF001


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(37, generator=g), "y": torch.randn(37, generator=g),
            "rows": torch.randn(5, 33, generator=g), "half": torch.randn(37, generator=g).to(torch.bfloat16)}


def _helion_on_cpu(t):
    """What Helion itself computes on CPU tensors (its launcher): the reference."""
    return {"add": add(t["x"], t["y"]), "add_bf16": add(t["half"], t["half"]), "softmax": row_softmax(t["rows"]),
            "scale": scale(t["x"], 2.5), "mul": mul(t["x"], t["y"])}


def _ours(t, kernels):
    a, s, sc, m = kernels
    return {"add": a(t["x"], t["y"]), "add_bf16": a(t["half"], t["half"]), "softmax": s(t["rows"]),
            "scale": sc(t["x"], 2.5), "mul": m(t["x"], t["y"])}


def _differences(got: dict, want: dict) -> dict:
    """Names whose results differ from Helion's (bit-exact expected: the same JAX interpret program)."""
    return {k: (tuple(got[k].shape), str(got[k].dtype), str(got[k].device)) for k in want
            if not torch.equal(got[k].detach().cpu(), want[k])}


def _shapes_run(op) -> set[tuple[int, ...]]:
    """Input shapes an op ran eagerly on CPU tensors (its per-signature program cache)."""
    keys = [key[1] if key[0] == "backward" else key[0] for key in op._runners]  # noqa: SLF001
    return {tuple(entry[0]) for signature in keys for entry in signature if entry is not None}


# -- CPU tensors, in this process -------------------------------------------------------------------
def test_cpu_results_equal_helion_and_torch():
    t = _inputs()
    want = _helion_on_cpu(t)
    torch.testing.assert_close(want["add"], t["x"] + t["y"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(want["softmax"], torch.softmax(t["rows"], -1), atol=TOL, rtol=TOL)
    with no_host_conversion():
        got = _ours(t, (as_op(add), softmax_op, scale_op, mul_op))
    assert _differences(got, want) == {}


def test_the_host_conversion_check_can_fail():
    with no_host_conversion(), pytest.raises(AssertionError, match="host conversion"):
        add(torch.ones(5), torch.ones(5))  # Helion's own launcher on CPU tensors: the path the patch catches


def test_compiled_graph_inlines_helion_kernels():
    """torch.compile(backend="tpu") on CPU tensors: plain @helion.kernel calls become ops of the XLA program."""
    torch._dynamo.reset()  # noqa: SLF001
    x, rows = torch.randn(19), torch.randn(3, 17)
    want = (add(x, x) * 2, row_softmax(rows + 1))

    def step(a, r):
        return add(a, a) * 2, row_softmax(r + 1)

    with no_host_conversion():
        got = torch.compile(step, backend="tpu", fullgraph=True, dynamic=False)(x, rows)
    # Inlined: the ops' own CPU programs (one per input signature) never ran for these shapes.
    assert (19,) not in _shapes_run(as_op(add)) and (3, 17) not in _shapes_run(softmax_op)
    as_op(add)(x, x)
    assert (19,) in _shapes_run(as_op(add))  # (the check above can fail)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_gradients_from_backward_kernel_torch_reference_and_jax():
    x, y, rows = (torch.randn(*s, requires_grad=True) for s in ((21,), (21,), (4, 9)))
    g = torch.linspace(-1, 1, 21)
    with no_host_conversion():
        got = torch.autograd.grad((mul_op(x, y) * g).sum() + (scale_op(x, alpha=3.0) * g).sum(), (x, y))
        got_rows = torch.autograd.grad((softmax_op(rows) * torch.arange(9.0)).sum(), rows)
    want = torch.autograd.grad((x * y * g).sum() + (x * 3.0 * g).sum(), (x, y))
    want_rows = torch.autograd.grad((torch.softmax(rows, -1) * torch.arange(9.0)).sum(), rows)
    for a, b in zip((*got, *got_rows), (*want, *want_rows)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_no_backward_is_a_clear_error():
    x = torch.randn(8, requires_grad=True)
    out = as_op(add)(x, x)
    with pytest.raises(KernelGradientError, match=r"Helion kernel 'add' compiles to Pallas, which has no "
                                                  r"reverse-mode gradient; pass backward="):
        out.sum().backward()


def test_autotuning_is_off_on_cpu_with_a_message_and_configs_are_used():
    @helion.kernel(**PALLAS)  # no config: Helion would autotune
    def negate(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for tile in hl.tile(out.size()):
            out[tile] = -x[tile]
        return out

    @helion.kernel(configs=[helion.Config(block_sizes=[8]), helion.Config(block_sizes=[32])], **PALLAS)
    def double(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for tile in hl.tile(out.size()):
            out[tile] = x[tile] * 2
        return out

    x = torch.randn(40)
    with pytest.warns(UserWarning, match=r"'negate': not autotuning in Pallas interpret mode on CPU.*Helion default"):
        assert torch.equal(as_op(negate)(x), -x)
    with pytest.warns(UserWarning, match=r"'double'.*block_sizes=\[8\].*first configs= entry"):
        assert torch.equal(as_op(double)(x), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one config given: used as is, nothing to say
        assert torch.equal(as_op(add)(x, x), x + x)
    configs = lambda kernel: [b._config for b in kernel._bound_kernels.values()]  # noqa: E731, SLF001
    assert helion.Config(block_sizes=[8]) in configs(double)
    assert helion.Config(block_sizes=[16]) in configs(add)


def test_bad_kernels_say_what_to_change():
    @helion.kernel(backend="triton", config=helion.Config(block_sizes=[16]))
    def on_triton(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match=r"backend='triton'.*pass backend='pallas'"):
        helion_op()(on_triton)

    @helion.kernel(**PALLAS)
    def takes_a_list(x: torch.Tensor, sizes: list) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match=r"parameter sizes .* neither a tensor nor a float/int/bool scalar"):
        helion_op()(takes_a_list)


# -- the "tpu" device, in a worker process ---------------------------------------------------------
@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=600) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def run_on_device(mode):
    """Plain @helion.kernel calls and helion_op ops on tpu tensors vs Helion on CPU, with syncs counted."""
    import tpudist.device  # noqa: F401

    t = _inputs()
    want = _helion_on_cpu(t)
    kernels = (add, row_softmax, scale_op, mul_op)  # plain Helion kernels are routed on tpu tensors
    with no_host_conversion(), torch.tpu.eager_mode(mode):
        on_device = {k: v.to("tpu") for k, v in t.items()}
        torch.tpu.synchronize()
        syncs = torch.tpu.cache_stats()["syncs"]
        got = _ours(on_device, kernels)
        syncs_during_calls = torch.tpu.cache_stats()["syncs"] - syncs
        devices = sorted({str(v.device) for v in got.values()})
        x, y = (on_device[k].requires_grad_() for k in ("x", "y"))
        grads = [g.cpu() for g in torch.autograd.grad(mul_op(x, y).sum(), (x, y))]
        differences = _differences(got, want)
    return differences, devices, syncs_during_calls, grads, (t["y"], t["x"])


def run_compiled_on_device():
    import tpudist.device  # noqa: F401

    torch._dynamo.reset()  # noqa: SLF001
    x, rows = torch.randn(23), torch.randn(6, 10)
    want = add(x, x) * 2, row_softmax(rows + 1)
    with no_host_conversion():
        step = torch.compile(lambda a, r: (add(a, a) * 2, row_softmax(r + 1)), backend="tpu", fullgraph=True,
                             dynamic=False)
        got = step(x.to("tpu"), rows.to("tpu"))
        return [g.device.type for g in got], [(g.cpu() - w).abs().max().item() for g, w in zip(got, want)]


@pytest.mark.parametrize("mode", ["debug", "strict", "fused"])
def test_device_tensors_run_without_host_copies(dev, mode):
    differences, devices, syncs, grads, want_grads = dev(run_on_device, mode)
    assert differences == {}
    assert devices == ["tpu:0"]
    if mode == "fused":
        assert syncs == 0  # recorded into the fused program
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_compiled_graph_on_device_tensors(dev):
    devices, errors = dev(run_compiled_on_device)
    assert devices == ["tpu", "tpu"]
    assert max(errors) <= TOL, errors


# -- DTensors, on two "tpu" ranks -------------------------------------------------------------------
def run_on_dtensors():
    """Uneven Shard(0) on 2 ranks: shard by shard (shard_dims) and over the mesh (a plain kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(3)
    x, y, rows = torch.randn(11, generator=g), torch.randn(11, generator=g), torch.randn(5, 12, generator=g)
    want = {"mul": mul(x, y), "softmax": row_softmax(rows), "add": add(x, y)}
    with no_host_conversion():
        dx, dy, drows = (distribute_tensor(t, mesh, [Shard(0)]) for t in (x, y, rows))
        got = {"mul": mul_op(dx, dy), "softmax": softmax_op(drows), "add": add(dx, dy)}
        placements = {k: tuple(v.placements) for k, v in got.items()}
        full = {k: v.full_tensor() for k, v in got.items()}
        dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        dy = distribute_tensor(y, mesh, [Shard(0)]).requires_grad_()
        mul_op(dx, dy).sum().backward()
        grads = dx.grad.full_tensor(), dy.grad.full_tensor()
    return _differences(full, want), placements, grads, (y, x)


def test_dtensors_shard_by_shard_and_over_the_mesh():
    from torch.distributed.tensor import Shard

    with RankPool(2, timeout=600) as pool:
        results = pool.run(run_on_dtensors)
    for differences, placements, grads, want_grads in results:
        assert differences == {}
        assert placements["mul"] == placements["softmax"] == (Shard(0),), placements  # shard by shard
        assert len(placements["add"]) == 1, placements  # a plain kernel: one program over the mesh
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


# -- the README flow in a fresh process: tpudist.device first, Helion imported after ---------------
_README_FLOW = """
import sys, torch, torch.nn.functional as F
import tpudist.device
assert "helion" not in sys.modules and "tpudist.kernels.helion" not in sys.modules  # no Helion import cost
import helion, helion.language as hl
from helion.runtime.pallas import launcher
launcher._torch_to_jax = None  # any host conversion now fails

@helion.kernel(backend="pallas", config=helion.Config(block_sizes=[2]))
def row_softmax(x: torch.Tensor) -> torch.Tensor:
    n, _m = x.size()
    out = torch.empty_like(x)
    for tile_n in hl.tile(n):
        out[tile_n, :] = F.softmax(x[tile_n, :], dim=1)
    return out

x = torch.randn(3, 10)
with torch.tpu.eager_mode("fused"):
    got = row_softmax(x.to("tpu")).cpu()
print(float((got - torch.softmax(x, -1)).abs().max()))
"""


def test_helion_imported_after_the_device_is_routed(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "flow.py"  # a file: Helion reads the kernel's source
    script.write_text(_README_FLOW)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) <= TOL
