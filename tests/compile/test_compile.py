"""torch.compile(backend="tpu") in one process, against eager torch on the CPU.

The decoder is the recipe's (tpudist.training.model), small; each test compiles once and shares
programs through the module's cache.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import probe_ops  # noqa: F401 - defines torch.ops.tpudist_test.mystery, which has no lowering
import tpudist.compile as tc
from tpudist.compile.program import STATS

ARGS = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
# CPU tensors' programs share host memory with torch only on JAX's CPU backend; on a chip they are copied
_host_programs = pytest.mark.skipif(
    __import__("jax").local_devices()[0].platform != "cpu",
    reason="zero-copy inputs and results are XLA:CPU's: a chip's programs read and write their own memory")
BATCH, SEQ = 2, 16


def _loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _train(dtype, steps=10, compiled=True):
    """Losses and final parameters of ``steps`` AdamW steps, eager and compiled from one init."""
    from tpudist.training.model import ModelArgs, Transformer

    torch.manual_seed(0)
    eager = Transformer(ModelArgs(**ARGS)).to(dtype)
    model = copy.deepcopy(eager)
    step = torch.compile(_loss, backend="tpu", fullgraph=True, dynamic=False)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, counts = [], []
    for _ in range(steps):
        tokens = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=gen)
        for net, opt, fn in ((eager, opt_e, _loss), (model, opt_c, step)):
            loss = fn(net, tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        counts.append((STATS.graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"]))  # noqa: SLF001
    return losses, counts, eager, model


@pytest.fixture(scope="module")
def trained():
    torch._dynamo.reset()  # noqa: SLF001
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        before = STATS.graphs
        losses, counts, eager, model = _train(dtype)
        out[dtype] = (losses, [(g - before, u) for g, u in counts], eager, model)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_decoder_trains_like_eager(trained, dtype, tol):
    losses, counts, eager, model = trained[dtype]
    eager_losses, compiled_losses = losses[0::2], losses[1::2]
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=tol, atol=tol)
    for (name, p_c), p_e in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p_c, p_e, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    # One forward and one backward XLA program, both built in step 1; nothing recompiles after it.
    assert counts[0][0] == 2, counts
    assert all(c == counts[0] for c in counts), counts


def test_entry_point_names_the_backend():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "tpu" in list_backends() and "tpudist" in list_backends()
    assert lookup_backend("tpu").__module__ == "tpudist.compile.entry"
    assert lookup_backend("tpudist") is lookup_backend("tpu")


def test_tpu_name_left_to_another_package(monkeypatch):
    """Another package registering Dynamo backend "tpu" keeps it (with a warning); ours stays "tpudist"."""
    import importlib.metadata

    from torch._dynamo.backends.debugging import eager

    from tpudist.compile import entry

    theirs = importlib.metadata.EntryPoint("tpu", "torch._dynamo.backends.debugging:eager", entry._GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [*real(group=group), theirs] if group == entry._GROUP else real(group=group))
    with pytest.warns(UserWarning, match='backend="tpudist"'):
        assert entry._choose_tpu() is eager
    monkeypatch.setattr(importlib.metadata, "entry_points", real)
    assert entry._choose_tpu() is entry.tpudist


def test_boundary_inputs():
    """int64 beyond 32 bits, non-contiguous, unaligned (storage offset), 0-d, empty, requires-grad."""

    def fn(i, nc, un, z, e, r):
        return i * 2 + 1, nc * 3.0 + un, z * 3, e + 1, (r * r).sum()

    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    i = torch.arange(10, dtype=torch.int64) * 2 ** 40
    nc = torch.randn(6, 4).t()
    un = torch.randn(4 * 6 + 1)[1:].view(4, 6)
    assert un.data_ptr() % 16 and not nc.is_contiguous()
    z, e = torch.tensor(2.5), torch.empty(0, 3)
    r = torch.randn(5, requires_grad=True)
    out = compiled(i, nc, un, z, e, r)
    ref = fn(i, nc, un, z, e, r.detach())
    for got, want in zip(out, ref):
        assert got.dtype == want.dtype and got.shape == want.shape
        # atol too: XLA fuses nc * 3.0 + un into one FMA, torch rounds twice; where the sum cancels
        # to near 0 the relative difference exceeds 1e-6 (a wrong layout would be off by O(1)).
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    out[-1].backward()
    torch.testing.assert_close(r.grad, 2 * r.detach())


@_host_programs
def test_boundary_does_not_copy_aligned_inputs():
    """An aligned contiguous CPU tensor enters XLA as its own memory, and its storage stays resizable."""
    import jax

    from tpudist.compile import boundary

    t = torch.randn(64, 32)
    device = jax.local_devices()[0]
    keep: list = []
    with jax.enable_x64(True):
        (arr,) = boundary.to_jax([t], [jax.core.ShapedArray((64, 32), jax.numpy.float32)],
                                 jax.sharding.SingleDeviceSharding(device), device, keep)
    assert t.data_ptr() % 64 == 0 and arr.unsafe_buffer_pointer() == t.data_ptr()
    out = boundary.to_torch(arr * 2, torch.float32)
    torch.testing.assert_close(out, t * 2)
    del arr, keep
    t.untyped_storage().resize_(0)  # what FSDP2 does to freed parameters: Tensor.numpy() would forbid it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_results_on_an_accelerator_come_back_as_host_copies(monkeypatch, dtype):
    """A CPU tensor's graph runs on the TPU chip where there is one: its results live in the chip's
    memory, whose addresses the host cannot read (read as host memory they were NaN on a v5e), so
    they come back as host copies, remembered for no later program. Here JAX's CPU arrays play the
    chip's (the test cannot fail on the chip's side without one)."""
    import jax

    from tpudist.compile import boundary

    monkeypatch.setattr(boundary, "_on_host", lambda array: False)
    want = (torch.arange(6 * 5) - 7).reshape(6, 5).to(dtype)
    with jax.enable_x64(True):  # as the programs run: an int64 result is an int64 array
        arrays = [jax.numpy.asarray(want.float().numpy()).astype(str(dtype).removeprefix("torch.")),
                  jax.numpy.zeros((0, 3))]
    got, empty = boundary.results(arrays, [((6, 5), dtype), ((0, 3), torch.float32)], device_id=0)
    assert got.dtype == dtype and torch.equal(got, want) and empty.shape == (0, 3)
    assert got.data_ptr() != arrays[0].unsafe_buffer_pointer()  # a copy, not the array's buffer
    assert not any(k[0] == got.data_ptr() for k in boundary._RESULTS)  # noqa: SLF001
    torch.testing.assert_close(boundary.to_torch(arrays[0], dtype), want)


def _grads_equal_eager_then_clear(model, eager, tokens):
    """The compiled step's gradients (already in ``model``) equal an eager step's; both cleared."""
    _loss(eager, tokens, tokens).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)


def test_results_are_tensors_of_their_own(trained):
    """Each result (every gradient, the loss) is a tensor over its own XLA buffer, exactly its size:
    no result keeps another's memory alive, and the values equal eager's."""
    _, _, eager, model = trained[torch.float32]
    tokens = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ))
    step = torch.compile(_loss, backend="tpu", fullgraph=True, dynamic=False)
    loss = step(model, tokens, tokens)
    loss.backward()
    results = [p.grad for p in model.parameters()] + [loss]
    assert len({r.untyped_storage().data_ptr() for r in results}) == len(results)
    for r in results:
        assert r.is_contiguous() and r.storage_offset() == 0
        assert r.untyped_storage().nbytes() == r.numel() * r.element_size()
    _grads_equal_eager_then_clear(model, eager, tokens)


def test_alias_cache_follows_the_memory_not_the_tensor():
    """A cached zero-copy input array is reused for whatever tensor lies at that address: a new
    tensor in freed memory, or one written in place, gives this call's values, never stale ones."""
    from tpudist.compile import boundary

    compiled = torch.compile(lambda x: x * 2 + 1, backend="tpu", fullgraph=True, dynamic=False)
    x = torch.zeros(256, 64)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    hits = len(boundary._ALIASES)  # noqa: SLF001
    x.copy_(torch.randn(256, 64))  # same memory, new values
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    assert len(boundary._ALIASES) == hits  # noqa: SLF001  (the same array served the second call)
    address = x.data_ptr()
    del x
    for _ in range(4):  # the allocator hands the freed block back for a tensor of the same size
        y = torch.randn(256, 64)
        torch.testing.assert_close(compiled(y), y * 2 + 1)
        if y.data_ptr() == address:
            break


@_host_programs
def test_results_enter_later_programs_as_they_are(trained, monkeypatch):
    """The activations a forward program saves enter the backward program as the arrays XLA made
    (no new device_put per tensor), and a result that is gone is not served again."""
    from jax._src.lib import xla_client

    from tpudist.compile import boundary

    _, _, eager, model = trained[torch.float32]
    tokens = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ))
    step = torch.compile(_loss, backend="tpu", fullgraph=True, dynamic=False)
    step(model, tokens, tokens).backward()  # compiled and warm: parameters are in the alias cache
    model.zero_grad(set_to_none=True)
    puts, put = [], xla_client.batched_device_put
    monkeypatch.setattr(xla_client, "batched_device_put", lambda *a, **k: puts.append(a[0]) or put(*a, **k))
    loss = step(model, tokens, tokens)
    forward_puts = len(puts)
    loss.backward()
    # At most the loss's incoming gradient (a fresh tensor) is put; the saved activations are not.
    assert len(puts) - forward_puts <= 1, puts[forward_puts:]
    _grads_equal_eager_then_clear(model, eager, tokens)
    monkeypatch.undo()
    x = torch.compile(lambda a: a + 1, backend="tpu", fullgraph=True, dynamic=False)(torch.ones(64, 64))
    address = x.data_ptr()
    assert any(k[0] == address for k in boundary._RESULTS)  # noqa: SLF001
    del x
    gc.collect()
    assert not any(k[0] == address for k in boundary._RESULTS)  # noqa: SLF001  (gone with its tensor)


def _with_mystery(x):
    y = x.sin()
    z = torch.ops.tpudist_test.mystery(y)  # the line the error must name
    return z.cos()


def test_missing_op_names_op_and_line():
    compiled = torch.compile(_with_mystery, backend="tpu", fullgraph=True, dynamic=False)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3))
    text = str(info.value)
    assert "tpudist_test.mystery.default" in text, text
    assert "test_compile.py" in text and "torch.ops.tpudist_test.mystery(y)" in text, text
    assert "on_missing_op" in text


def test_missing_op_graph_break_option():
    compiled = torch.compile(_with_mystery, backend="tpu", dynamic=False, options={"on_missing_op": "graph_break"})
    x = torch.randn(3)
    with pytest.warns(UserWarning, match="eagerly"):
        got = compiled(x)
    torch.testing.assert_close(got, _with_mystery(x))


def test_automatic_dynamic_sizes_share_a_bucket():
    """Dynamo's default goes dynamic on a second size: the backend pads it to a bucket (no error)."""
    from tpudist.compile import dynamic

    def fn(x):
        return x * 2

    compiled = torch.compile(fn, backend="tpu")
    before = dynamic.STATS.snapshot()
    for n in (4, 5, 6, 9):
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(x), fn(x))
    after = dynamic.STATS.snapshot()
    # size 4 compiled statically; 5, 6 and 9 share one padded program (dim 0 pads to 128)
    assert after["padded_programs"] - before["padded_programs"] == 1, (before, after)
    assert after["exact_programs"] == before["exact_programs"], (before, after)


@pytest.mark.parametrize("dynamic", [False, True])
def test_logspace_equals_eager_bit_for_bit(dynamic):
    """torch.logspace reaches the table's lowering whole (torch's CPU kernel, on the host). Through torch's
    decomposition, pow(base, linspace(start, end) in float64), 15 of the 50 float32 values of (-2.3, 1.9) were an
    ulp off (20 in bfloat16), and the chip would compute a float64 pow. Dynamo specializes the floats either way."""
    def fn(x, start: float, end: float):
        return torch.logspace(start, end, 50, base=2.5, dtype=x.dtype) + x

    for dtype in (torch.float32, torch.bfloat16, torch.int16):
        torch._dynamo.reset()  # noqa: SLF001 - one specialization per (start, end): stay under the recompile limit
        compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=dynamic)
        x = torch.zeros(50, dtype=dtype)
        for start, end in ((-2.3, 1.9), (0.1, 3.7), (2.0, -3.0)):
            got, want = compiled(x, start, end), fn(x, start, end)
            assert got.dtype == want.dtype and torch.equal(got, want), (dtype, start, end, (got != want).sum())


def test_bad_option():
    with pytest.raises(ValueError, match="on_missing_op"):
        tc.backend(None, [], options={"on_missing_op": "cpu"})
    with pytest.raises(ValueError, match="not known"):
        tc.backend(None, [], options={"fast": True})
    with pytest.raises(TypeError, match="xla_options"):
        tc.backend(None, [], options={"xla_options": ["xla_cpu_multi_thread_eigen"]})


def test_dropout_seeded_masks_and_keep_rate():
    p = 0.25

    def fn(x):
        return F.dropout(x, p=p, training=True)

    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    x = torch.ones(200, 100, requires_grad=True)
    torch.manual_seed(3)
    a = compiled(x)
    torch.manual_seed(3)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    n = x.numel()
    kept = (a != 0).sum().item()
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(kept - n * (1 - p)) <= 3 * sigma, (kept, n * (1 - p), sigma)
    torch.testing.assert_close(a[a != 0], torch.full((kept,), 1 / (1 - p)))
    a.sum().backward()
    assert torch.equal(x.grad, a.detach())  # the backward reuses the forward's mask


def _layouts(x):
    """Results torch lays out densely but not row-major, and one with gaps (comes out contiguous)."""
    return ((x * 2).transpose(1, 3), x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) + 1,
            (x + 1).contiguous(memory_format=torch.channels_last), x[:, :, ::2] * 3, (x * 5)[:, :, ::2])


def test_results_keep_eager_strides():
    """A transposed result and channels_last ones come back with eager's strides, so code that views
    them works as in eager (a view of eager's layout raised on the contiguous copies this returned);
    values and gradients equal eager's."""
    x = torch.randn(2, 3, 4, 5)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = torch.compile(_layouts, backend="tpu", fullgraph=True, dynamic=False)(xc), _layouts(xe)
    for i, (g, w) in enumerate(zip(got, want)):
        if i < 4:
            assert g.stride() == w.stride(), (i, g.stride(), w.stride())
        torch.testing.assert_close(g, w, msg=str(i))
    torch.testing.assert_close(got[0].transpose(1, 3).view(-1), want[0].transpose(1, 3).view(-1))
    torch.testing.assert_close(got[2].permute(0, 2, 3, 1).view(-1, 3), want[2].permute(0, 2, 3, 1).view(-1, 3))
    weights = [torch.randn(w.shape) for w in want]
    sum((g * k).sum() for g, k in zip(got, weights)).backward()
    sum((w * k).sum() for w, k in zip(want, weights)).backward()
    torch.testing.assert_close(xc.grad, xe.grad)


_DEVICE_CHILD = textwrap.dedent("""
    import copy, json, torch, torch.nn.functional as F
    import tpudist.device  # renames PrivateUse1 for the whole process: hence a process of its own
    from tpudist.compile.program import STATS
    from tpudist.training.model import ModelArgs, Transformer

    torch.manual_seed(0)
    eager = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    model = copy.deepcopy(eager).to("tpu")

    def loss_fn(m, tokens, targets):
        return F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())

    step = torch.compile(loss_fn, backend="tpu", fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(1)
    losses, devices, grad_err = [], set(), 0.0
    for _ in range(2):  # forward and backward only: the eager device optimizer compiles per op (slow)
        tokens, targets = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)
        loss_c = step(model, tokens.to("tpu"), targets.to("tpu"))
        devices.add(loss_c.device.type)
        loss_c.backward()
        devices.update(p.grad.device.type for p in model.parameters())
        loss_e = loss_fn(eager, tokens, targets)
        loss_e.backward()
        grad_err = max([grad_err] + [(a.grad.cpu() - b.grad).abs().max().item()
                                     for a, b in zip(model.parameters(), eager.parameters())])
        losses.append((loss_c.item(), loss_e.item()))
    print(json.dumps({"losses": losses, "grad_err": grad_err, "devices": sorted(devices),
                      "graphs": STATS.graphs, "shaped": [STATS.shaped_results, STATS.shaped_inputs],
                      "flattened": torch.tpu.cache_stats().get("shaped_flattened", 0)}))
""")


def test_tpu_device_tensors():
    """Model and batch on the "tpu" device: the programs take the storages' arrays, results stay on it.
    The activations the forward saves leave it in their own shape and enter the backward so (on a TPU a
    flat <-> N-d reshape is a copy): none is flattened on the way."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _DEVICE_CHILD], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == ["tpu"] and out["graphs"] == 2, out
    assert out["shaped"][0] > 0 and out["shaped"][0] == out["shaped"][1] and out["flattened"] == 0, out
    for compiled, eager in out["losses"]:
        assert abs(compiled - eager) <= 1e-5, out
    assert out["grad_err"] <= 1e-5, out


_CACHE_CHILD = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    from tpudist.compile.program import STATS
    from tpudist.training.model import ModelArgs, Transformer

    def cache_run():
        torch.manual_seed(0)
        model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=8))

        def step(t):
            return F.cross_entropy(model(t).flatten(0, 1), t.flatten())

        loss = torch.compile(step, backend="tpu", fullgraph=True, dynamic=False)(torch.randint(0, 64, (2, 8)))
        loss.backward()
        return {"loss": loss.item(), **STATS.snapshot()}

    if __name__ == "__main__":
        print(json.dumps(cache_run()))
""")


def test_second_process_reuses_compiled_programs(tmp_path):
    """Two fresh processes on one empty cache directory: the second loads what the first compiled."""
    env = dict(os.environ, TPUDIST_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _CACHE_CHILD], env=env, capture_output=True, text=True,
                              timeout=400)  # a cold compile under a loaded machine can take minutes
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["programs_compiled"] == 2 and warm["programs_compiled"] == 0 and warm["disk_hits"] == 2, (cold, warm)
    assert warm["loss"] == cold["loss"]
