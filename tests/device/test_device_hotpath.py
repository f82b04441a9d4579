"""The per-op hot path of the "tpu" device (signature, kernel cache, Fused recording) against CPU eager.

Every branch the signature takes on its fast path (positional tensors only) and off it (lists,
keyword arguments) is run twice in each mode: the first call builds the kernel, the second must
reuse it (counted: hits up, no new kernel) and give the same values as CPU. The cases are the ones a
cheaper signature could get wrong: two arguments on one storage, views at an offset, size-1 dims,
the lazy conj and neg bits, CPU 0-dim scalars, Python floats, several outputs, in-place writes.
"""

from __future__ import annotations

import pytest
import torch

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _cases():
    """(name, fn) pairs: fn(tensors) -> a tensor or a tuple of tensors, run on CPU and on tpu copies."""
    return [
        ("add", lambda t: t["a"] + t["b"]),
        ("same storage twice", lambda t: t["a"] + t["a"]),
        ("view and its base", lambda t: t["a"][:, 1:] * t["a"][:, :-1]),
        ("offset view", lambda t: t["a"][2:5] - t["b"][1:4]),
        ("size-1 dim", lambda t: t["a"][:, -1:] + t["a"][:, :1]),
        ("transposed", lambda t: t["a"].t() @ t["b"]),
        ("python float", lambda t: t["a"] * 2.5 + 0.25),
        ("python int", lambda t: t["a"] + 3),
        ("cpu 0-dim float", lambda t: t["a"] * torch.tensor(1.5)),
        ("cpu 0-dim int", lambda t: t["i"] + torch.tensor(7)),
        ("cpu 0-dim bool", lambda t: t["a"] * torch.tensor(True)),
        ("cpu 0-dim float64 into float32", lambda t: t["a"] + torch.tensor(0.1, dtype=torch.float64)),
        ("conj bit", lambda t: t["c"].conj() + t["c"]),
        ("neg bit on a real view", lambda t: t["c"].conj().imag + t["a"][:, :4]),
        ("list argument", lambda t: torch.cat([t["a"], t["b"]], dim=1)),
        ("keyword argument", lambda t: torch.sum(t["a"], dim=0, keepdim=True)),
        ("several outputs", lambda t: torch.max(t["a"], dim=1)),
        # a foreach op's fresh results: a flat list (built without torch's pytree)
        ("list of results", lambda t: tuple(torch._foreach_sqrt([t["a"].abs(), t["b"].abs()]))),
        ("in-place on a view", lambda t: t["a"].clone()[1:].add_(t["b"][1:], alpha=0.5)),
        ("out=", lambda t: torch.mul(t["a"], t["b"], out=torch.empty_like(t["a"]))),
        ("dtype", lambda t: (t["a"] > 0).to(torch.float32) + t["i"]),
        # matmul reshapes the mm result with _unsafe_view: a new tensor over the result's storage
        ("3-d matmul, then in-place", lambda t: torch.matmul(t["a"].reshape(2, 3, 5), t["b"].t()).mul_(2)),
    ]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(6, 5, generator=g), "b": torch.randn(6, 5, generator=g),
            "i": torch.randint(-5, 5, (6, 5), generator=g),
            "c": torch.randn(6, 4, dtype=torch.complex64, generator=g)}


def _run_cases(mode):
    import tpudist.device  # noqa: F401

    host = _inputs()
    out = {}
    with torch.tpu.eager_mode(mode):
        for name, fn in _cases():
            want = fn({k: v.clone() for k, v in host.items()})
            rounds = []
            for _ in range(2):
                tensors = {k: v.to("tpu") for k, v in host.items()}
                torch.tpu.synchronize()
                before = torch.tpu.cache_stats()
                got = fn(tensors)
                got = tuple(x.cpu() for x in got) if isinstance(got, tuple) else got.cpu()
                after = torch.tpu.cache_stats()
                rounds.append({k: after[k] - before[k] for k in ("kernels", "hits", "misses")})
            want = tuple(want) if isinstance(want, tuple) else want
            out[name] = (want, got, rounds)
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_hot_path_matches_cpu_and_hits_the_cache(dev, mode):
    results = dev(_run_cases, mode)
    assert [name for name, _ in _cases()] == list(results)
    for name, (want, got, rounds) in results.items():
        wants, gots = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        assert len(wants) == len(gots), name
        for w, g in zip(wants, gots):
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name} ({mode})")
        second = rounds[1]
        # the second run of the same calls builds nothing: every op is a cache hit
        assert second["kernels"] == 0 and second["misses"] == 0, (name, mode, rounds)
        assert second["hits"] >= 1, (name, mode, rounds)


def _repeated_add_counts():
    import tpudist.device  # noqa: F401
    from tpudist.device import _fused

    x, y = torch.randn(8, 8).to("tpu"), torch.randn(8, 8).to("tpu")
    with torch.tpu.eager_mode("fused"):
        z = x + y
        torch.tpu.synchronize()
        before = torch.tpu.cache_stats()
        for _ in range(50):
            z = z + y
        pending = _fused.pending_ops()
        recorded_before_sync = torch.tpu.cache_stats()["recorded_ops"] - before["recorded_ops"]
        value = z.cpu()
        after = torch.tpu.cache_stats()
    want = x.cpu() + y.cpu()
    for _ in range(50):
        want = want + y.cpu()
    counts = {k: after[k] - before[k] for k in ("kernels", "hits", "misses", "recorded_ops", "syncs")}
    return (pending, recorded_before_sync), counts, value, want


def test_fused_records_a_chain_of_hits(dev):
    (pending, recorded_before_sync), counts, value, want = dev(_repeated_add_counts)
    assert pending == 50 and recorded_before_sync == 50  # cache_stats counts the ops still pending
    assert counts == {"kernels": 0, "hits": 50, "misses": 0, "recorded_ops": 50, "syncs": 1}, counts
    torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)


def _matmul_counts():
    import tpudist.device  # noqa: F401

    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    out = {}
    for mode in ("strict", "fused"):
        with torch.tpu.eager_mode(mode):
            at, bt = a.to("tpu"), b.to("tpu")
            torch.tpu.synchronize()
            before = torch.tpu.cache_stats()
            r = torch.matmul(at, bt)
            r.add_(1.0)
            value = r.cpu()
            after = torch.tpu.cache_stats()
        out[mode] = (after["ops"] - before["ops"] + after["recorded_ops"] - before["recorded_ops"], value)
    return out, a @ b + 1


def test_unsafe_view_is_metadata_only(dev):
    """matmul of a 3-d tensor is mm + _unsafe_view: only mm (and the add_) run on the device."""
    out, want = dev(_matmul_counts)
    for mode, (num_ops, value) in out.items():
        assert num_ops == 2, (mode, num_ops)
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)


def _random_and_mismatch(mode):
    import tpudist.device  # noqa: F401

    x = torch.ones(256, device="tpu")
    out = {}
    with torch.tpu.eager_mode(mode):
        torch.tpu.manual_seed(3)
        masks = [torch.nn.functional.dropout(x, 0.5) for _ in range(3)]  # one draw of the counter each
        out["masks"] = [m.cpu() for m in masks]
        try:
            x + torch.ones(256)  # a CPU tensor that is not a 0-dim scalar
        except RuntimeError as e:
            out["mismatch"] = str(e)
    return out


def test_random_ops_draw_once_per_op_and_host_tensors_are_refused(dev):
    """Fused records a random op's counter where Strict draws it at the call: the same seed gives the
    same masks in both modes, each op a fresh one; a CPU tensor that is not a scalar is refused in both."""
    strict, fused = dev(_random_and_mismatch, "strict"), dev(_random_and_mismatch, "fused")
    for a, b in zip(strict["masks"], fused["masks"]):
        assert torch.equal(a, b)
    assert not torch.equal(strict["masks"][0], strict["masks"][1])
    assert not torch.equal(strict["masks"][1], strict["masks"][2])
    for out in (strict, fused):
        assert "Expected all tensors to be on the same device" in out.get("mismatch", ""), out.get("mismatch")


def run_low_precision_chain(mode: str, dtype: torch.dtype) -> dict:
    """A chain of pointwise ops in a 16-bit dtype: CPU eager rounds after every op; so must the device,
    in Fused mode too (one XLA program, where XLA may otherwise keep f32 between the ops)."""
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    x, y = torch.randn(4096, dtype=dtype), torch.randn(4096, dtype=dtype)

    def chain(x, y):
        return ((x * y + x) * 1.7 - y).exp() * x

    with torch.tpu.eager_mode(mode):
        got = chain(x.to("tpu"), y.to("tpu")).cpu()
    return {"cpu": chain(x, y), "tpu": got}


@pytest.mark.parametrize("mode, dtype", [("strict", torch.bfloat16), ("fused", torch.bfloat16),
                                         ("strict", torch.float16), ("fused", torch.float16)])
def test_16_bit_chains_round_after_every_op_like_cpu(dev, mode, dtype):
    """Bit for bit, but float16 chains in one Fused program: on some CPUs (measured: 12.9% of the elements)
    they are 1 ulp from CPU eager, with xla_allow_excess_precision off (not found yet; on an AVX512 AMD
    EPYC they are exact), so those are held to 1 ulp."""
    out = dev(run_low_precision_chain, mode, dtype)
    ulps = (out["tpu"].view(torch.int16).int() - out["cpu"].view(torch.int16).int()).abs().max().item()
    allowed = 1 if (mode, dtype) == ("fused", torch.float16) else 0
    assert ulps <= allowed, f"{(out['tpu'] != out['cpu']).float().mean().item():.1%} of the elements differ " \
                            f"from CPU eager, by up to {ulps} ulp"


def run_equal(mode: str) -> dict:
    import tpudist.device  # noqa: F401

    cases = [(torch.tensor([1, 2]), torch.tensor([1.0, 2.0])),  # promoted, as on the CPU
             (torch.tensor([float("nan")]), torch.tensor([float("nan")])), (torch.ones(2, 1), torch.ones(2)),
             (torch.ones(0), torch.ones(0)), (torch.tensor([True]), torch.tensor([1])),
             (torch.arange(6.0).reshape(2, 3).t(), torch.arange(6.0).reshape(2, 3).t().contiguous()),
             (torch.ones(3), torch.tensor([1.0, 1.0, 2.0]))]
    with torch.tpu.eager_mode(mode):
        got = [torch.equal(a.to("tpu"), b.to("tpu")) for a, b in cases]
    return {"cpu": [torch.equal(a, b) for a, b in cases], "tpu": got}


@pytest.mark.parametrize("mode", ["debug", "strict", "fused"])
def test_torch_equal_is_a_sync_point_like_item(dev, mode):
    """``torch.equal`` on tpu tensors gives CPU's answer (it raised NotImplementedError: a Python bool)."""
    out = dev(run_equal, mode)
    assert out["tpu"] == out["cpu"] == [True, False, False, True, True, True, False]
