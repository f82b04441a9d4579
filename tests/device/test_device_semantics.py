"""Module and mutation semantics of the "tpu" device against CPU eager torch, in Debug, Strict and Fused modes.

Two silent divergences this file pins down: ``.to("tpu")`` must keep tied and shared parameters one
object (as CUDA does: torch moves them in place with ``param.data = ...``), and every write an op makes
into its arguments (``Tensor(a!)`` in its schema, and native_batch_norm's undeclared running-stat
update) must land in the device tensors. Like tests/device/test_device.py, every case runs in one worker
process that imports ``tpudist.device`` (which renames PrivateUse1 for its whole process).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tpudist.testing import RankPool

MODES = ("debug", "strict", "fused")


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _host(x):
    """Device results as CPU values (tensors, nested in lists/tuples/dicts) for the comparison."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_host(i) for i in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x


def _max_diff(a, b) -> float:
    a, b = _leaves(a), _leaves(b)
    assert [x.shape for x in a] == [y.shape for y in b], ([x.shape for x in a], [y.shape for y in b])
    return max([(x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()], default=0.0)


def _max_abs(x) -> float:
    return max([t.double().abs().max().item() for t in _leaves(x) if t.numel()], default=0.0)


def _leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in _leaves(x[k])]
    return [leaf for i in x for leaf in _leaves(i)]


# -- helpers that run in the worker ------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    """GPT-2 style: the LM head shares the token embedding's weight."""

    def __init__(self, vocab=37, dim=12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(9, dim) * 0.1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        return self.head(self.norm(h + self.mlp(h)))


def _tied_pair():
    e, h = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    h.weight = e.weight
    return torch.nn.ModuleDict(dict(e=e, h=h, bn=torch.nn.BatchNorm1d(4)))


def run_module_identity(mode):
    import tpudist.device  # noqa: F401

    out = {}
    with torch.tpu.eager_mode(mode):
        torch.manual_seed(0)
        cpu = _tied_pair()
        m = copy.deepcopy(cpu)
        w = m["e"].weight
        idx = torch.tensor([1, 3, 3, 7])
        cpu["h"](cpu["e"](idx)).square().sum().backward()  # grads exist before the move
        m["h"](m["e"](idx)).square().sum().backward()
        m.to("tpu")
        out["tied"] = m["e"].weight is m["h"].weight
        out["same_object"] = m["e"].weight is w and w.device.type == "tpu"
        out["counts"] = (len(list(m.parameters())), len(list(m.named_parameters(remove_duplicate=False))),
                         len(list(m.buffers())))
        out["cpu_counts"] = (len(list(cpu.parameters())), len(list(cpu.named_parameters(remove_duplicate=False))),
                             len(list(cpu.buffers())))
        out["grad"] = (w.grad.device.type, torch.equal(w.grad.cpu(), cpu["e"].weight.grad))
        cpu["h"](cpu["e"](idx)).square().sum().backward()  # a second backward accumulates into the moved grad
        m["h"](m["e"](idx.to("tpu"))).square().sum().backward()
        out["grad_accumulates"] = torch.allclose(w.grad.cpu(), cpu["e"].weight.grad, rtol=1e-6, atol=1e-6)
        out["buffers"] = sorted({b.device.type for b in m.buffers()})
        out["state_dict_keys"] = (sorted(m.state_dict()), sorted(cpu.state_dict()))

        # load_state_dict of other (CPU) values keeps the tie and writes both names' one tensor
        other = _tied_pair().state_dict()
        m.load_state_dict(other)
        out["loaded"] = (m["e"].weight is m["h"].weight, torch.equal(m["h"].weight.cpu(), other["h.weight"]))

        clone = copy.deepcopy(m)
        out["deepcopy"] = (clone["e"].weight is clone["h"].weight, clone["e"].weight.device.type,
                           torch.equal(clone["e"].weight.cpu(), m["e"].weight.cpu()))

        # cpu_param.data = tpu_tensor, and back, as on CUDA
        p = torch.nn.Parameter(torch.ones(3))
        p.data = torch.arange(3.0).to("tpu")
        q = (p * 2).sum()
        q.backward()
        out["data_assign"] = (p.device.type, p.requires_grad, p.grad.cpu().tolist())
        p.data = torch.zeros(2)
        out["data_back"] = (p.device.type, p.tolist())

        # an optimizer built on the CPU model keeps driving it after .to("tpu")
        torch.manual_seed(1)
        ref = torch.nn.Linear(3, 2)
        net = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        net.to("tpu")
        x = torch.randn(4, 3)
        for model, o, xx in ((ref, ref_opt, x), (net, opt, x.to("tpu"))):
            model(xx).square().sum().backward()
            o.step()
        out["opt_before_to"] = _max_diff([ref.weight, ref.bias], [net.weight.cpu(), net.bias.cpu()])

        # the round trip back to the CPU keeps identity and values
        m.to("cpu")
        out["round_trip"] = (m["e"].weight is m["h"].weight, m["e"].weight.device.type, w is m["e"].weight,
                             torch.equal(m["h"].weight, other["h.weight"]), w.grad.device.type)

        # torch's swap-tensors conversion (torch.__future__) keeps identity too
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            s = _tied_pair().to("tpu")
            out["swap"] = (s["e"].weight is s["h"].weight, s["e"].weight.device.type)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    return out


def run_tied_training(mode, optimizer_before_to, steps=5):
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    cpu = TiedLM()
    tpu = copy.deepcopy(cpu)

    def make(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    cpu_opt = make(cpu.parameters())
    tpu_opt = make(tpu.parameters()) if optimizer_before_to else None
    tpu.to("tpu")
    tpu_opt = tpu_opt or make(tpu.parameters())
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 37, (3, 7), generator=g), torch.randint(0, 37, (3, 7), generator=g))
               for _ in range(steps)]
    ref, got = [], []
    with torch.tpu.eager_mode(mode):
        for model, opt, losses, device in ((cpu, cpu_opt, ref, "cpu"), (tpu, tpu_opt, got, "tpu")):
            for x, y in batches:
                loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
    counts = (len(list(cpu.parameters())), len(list(tpu.parameters())))
    state_counts = (len(cpu_opt.state), len(tpu_opt.state))
    params = {k: v.detach().cpu() for k, v in tpu.named_parameters()}
    return ref, got, counts, state_counts, dict(cpu.named_parameters()), params


def _bn_cases():
    nn = torch.nn
    return [
        ("1d_nc", nn.BatchNorm1d, (16, 3), {}),
        ("1d_ncl_no_affine", nn.BatchNorm1d, (5, 3, 7), {"affine": False}),
        ("2d_cumulative", nn.BatchNorm2d, (4, 3, 5, 6), {"momentum": None}),
        ("2d_no_stats", nn.BatchNorm2d, (3, 4, 5, 5), {"track_running_stats": False}),
        ("3d_momentum", nn.BatchNorm3d, (2, 5, 3, 4, 3), {"momentum": 0.3, "eps": 1e-3}),
        ("2d_bf16", nn.BatchNorm2d, (4, 3, 3, 5), {"dtype": torch.bfloat16}),
    ]


def run_batch_norm(mode):
    """Train-mode forwards and backwards, then an eval forward, on CPU and the device."""
    import tpudist.device  # noqa: F401

    results = {}
    with torch.tpu.eager_mode(mode):
        for name, cls, shape, kwargs in _bn_cases():
            torch.manual_seed(0)
            cpu = cls(shape[1], **kwargs)
            if cpu.affine:
                with torch.no_grad():
                    cpu.weight.uniform_(0.5, 1.5)
                    cpu.bias.uniform_(-0.5, 0.5)
            tpu = copy.deepcopy(cpu).to("tpu")
            g = torch.Generator().manual_seed(1)
            dtype = kwargs.get("dtype", torch.float32)
            xs = [(torch.randn(shape, generator=g) * 2 + 5).to(dtype) for _ in range(3)]
            probe = torch.randn(shape, generator=g).to(dtype)
            per_model = []
            for model, device in ((cpu, "cpu"), (tpu, "tpu")):
                model.train()
                outs, grads = [], []
                for x in xs:
                    x = x.clone().to(device).requires_grad_(True)
                    y = model(x)
                    (y * probe.to(device)).sum().backward()
                    outs.append(y)
                    grads.append(x.grad)
                model.eval()
                outs.append(model(xs[0].to(device)))
                state = {k: v for k, v in model.state_dict().items()}
                pgrads = [p.grad for p in model.parameters()]
                per_model.append(_host((outs, grads, state, pgrads)))
            results[name] = per_model
    return results


class _IndexRows(torch.nn.Module):
    """w[int tensor] with repeated rows: its backward is _index_put_impl_ with accumulate."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 3))

    def forward(self, x):
        rows = torch.tensor([0, 2, 2, 5], device=x.device)
        return self.w[rows] * x


def run_masked_backward(mode):
    """Backwards whose output_mask turns a gradient off: the first layer's input needs no gradient.

    Returns the parameter-gradient differences from CPU and how many ops ran concretely (outside a
    cached program) on the device.
    """
    import tpudist.device  # noqa: F401

    nn = torch.nn
    out = {}
    with torch.tpu.eager_mode(mode):
        for name, make, shape in (("batch_norm_first", lambda: nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 3)), (8, 5)),
                                  ("conv_first", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), (2, 3, 6, 6)),
                                  ("index_rows", _IndexRows, (4, 3))):
            torch.manual_seed(0)
            cpu = make()
            tpu = copy.deepcopy(cpu).to("tpu")
            x = torch.randn(shape) * 3 + 2
            concrete = torch.tpu.cache_stats().get("concrete_ops", 0)
            for model, device in ((cpu, "cpu"), (tpu, "tpu")):
                for _ in range(2):
                    model(x.to(device)).square().sum().backward()
            grads = [_max_diff(b.grad.cpu(), a.grad) / max(1.0, _max_abs(a.grad))
                     for a, b in zip(cpu.parameters(), tpu.parameters())]
            out[name] = (max(grads), torch.tpu.cache_stats().get("concrete_ops", 0) - concrete)
    return out


def _mutation_cases():
    """Ops that write into their arguments, through views, lists and .data: (name, case(m))."""
    aten = torch.ops.aten

    def index_put_accumulate(m):
        x = m(torch.zeros(4, 3)); x.index_put_((m(torch.tensor([0, 2, 0])),), m(torch.ones(3, 3)), accumulate=True)
        return x

    def index_put_view(m):
        x = m(torch.arange(20.).view(4, 5)); v = x[1:, ::2]; v[m(torch.tensor([0, 2]))] = m(torch.tensor(-1.))
        return x

    def scatter_views(m):
        x = m(torch.zeros(3, 6)); idx = m(torch.tensor([[0, 1, 2], [2, 1, 0]]))
        x[1:, ::2].scatter_(1, idx, m(torch.arange(6.).view(2, 3)))
        x[:2].scatter_add_(1, idx, m(torch.ones(2, 3)))
        x.t().scatter_reduce_(0, m(torch.tensor([[1, 0, 2]])), m(torch.tensor([[5., 6., 7.]])), "amax")
        return x

    def masked_fill_transposed(m):
        x = m(torch.arange(12.).view(3, 4)); v = x.t()[1:]; v.masked_fill_(v > 5, -3.0)
        return x

    def copy_into_views(m):
        x = m(torch.zeros(4, 4)); x[::2, 1:3].copy_(torch.tensor([[1., 2.], [3., 4.]]))
        x.diagonal().copy_(m(torch.arange(4.))); x[3].copy_(m(torch.arange(2.)).repeat(2))
        return x

    def data_writes(m):
        p = torch.nn.Parameter(m(torch.ones(2, 3))); p.data.add_(1); p.data[0].mul_(3); p.data[:, 1:].sub_(0.5)
        return p.detach()

    def index_family(m):
        x = m(torch.arange(15.).view(5, 3)); i = m(torch.tensor([4, 0]))
        x.index_add_(0, i, m(torch.ones(2, 3)), alpha=2); x.index_copy_(1, m(torch.tensor([2])), m(torch.zeros(5, 1)))
        x.index_fill_(0, m(torch.tensor([1])), 7.0)
        x.masked_scatter_(x > 10, m(torch.arange(100., 115.)))
        return x

    def foreach_shared_storage(m):
        flat = m(torch.arange(12.)); a, b, c = flat[:4], flat[4:10].view(2, 3), m(torch.ones(3))
        torch._foreach_add_([a, b, c], [m(torch.ones(4)), m(torch.full((2, 3), 2.)), c])
        torch._foreach_mul_([a, b], 3.0); torch._foreach_addcmul_([a, c], [a, c], [a, c], value=0.5)
        torch._foreach_lerp_([b], [m(torch.zeros(2, 3))], 0.25)
        return flat, c

    def clamp_diagonal_and_out(m):
        x = m(torch.arange(16.).view(4, 4) - 8); x.diagonal().clamp_(min=-1, max=1)
        torch.add(m(torch.ones(2, 2)), m(torch.ones(2, 2)), alpha=3, out=x[2:, :2])
        x[:2, 2:].addmm_(m(torch.eye(2)), m(torch.ones(2, 2)), beta=0.5)
        return x

    def native_batch_norm_legit(m):
        rm, rv, x = m(torch.zeros(3)), m(torch.ones(3)), m(torch.arange(24.).view(4, 3, 2) / 7)
        y = aten._native_batch_norm_legit.default(x, None, None, rm, rv, True, 0.2, 1e-5)
        w, b = m(torch.tensor([1.0, 2.0, 0.5])), m(torch.tensor([0.0, -1.0, 1.0]))
        z = aten._batch_norm_with_update.default(x * 2, w, b, rm, rv, 0.5, 1e-5)  # torch's meta needs weights
        return rm, rv, y, z[:3]

    def native_batch_norm_out(m):
        rm, rv, x = m(torch.zeros(3)), m(torch.ones(3)), m(torch.arange(12.).view(4, 3) / 3)
        out, mean, invstd = m(torch.empty(0)), m(torch.empty(3)), m(torch.empty(3))
        aten.native_batch_norm.out(x, None, None, rm, rv, True, 0.4, 1e-5, out=out, save_mean=mean,
                                   save_invstd=invstd)
        return rm, rv, out, mean, invstd

    return [index_put_accumulate, index_put_view, scatter_views, masked_fill_transposed, copy_into_views,
            data_writes, index_family, foreach_shared_storage, clamp_diagonal_and_out,
            native_batch_norm_legit, native_batch_norm_out]


def run_mutations(mode):
    import tpudist.device  # noqa: F401

    out = []
    # the ops that fell back to the CPU here: the counts are the process's (a worker's earlier tests, or
    # every earlier test where the suite runs in one process on a chip)
    before = dict(torch.tpu.cache_stats()["cpu_fallback_ops"])
    with torch.tpu.eager_mode(mode):
        for case in _mutation_cases():
            ref = case(lambda t: t.clone())
            got = _host(case(lambda t: t.to("tpu")))
            out.append((case.__name__, ref, got))
        after = torch.tpu.cache_stats()["cpu_fallback_ops"]
    return out, {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


def _optimizers():
    O = torch.optim
    return {
        "adam": lambda p: O.Adam(p, lr=1e-2, foreach=False),
        "adam_foreach_amsgrad": lambda p: O.Adam(p, lr=1e-2, foreach=True, amsgrad=True),
        "adamw": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
        "adamw_foreach": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
        "sgd_momentum": lambda p: O.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        "sgd_nesterov_foreach": lambda p: O.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                foreach=True),
    }


def run_optimizers(mode, steps=3):
    """Parameters and optimizer state after a few steps, CPU and device."""
    import tpudist.device  # noqa: F401

    out = {}
    with torch.tpu.eager_mode(mode):
        for name, make in _optimizers().items():
            torch.manual_seed(0)
            cpu = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
            tpu = copy.deepcopy(cpu).to("tpu")
            g = torch.Generator().manual_seed(3)
            xs = [torch.randn(6, 5, generator=g) for _ in range(steps)]
            per = []
            for model, device in ((cpu, "cpu"), (tpu, "tpu")):
                opt = make(model.parameters())
                for x in xs:
                    model(x.to(device)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                state = [{k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
                         for p in model.parameters()]
                per.append(_host((list(model.parameters()), state)))
            out[name] = per
    return out


def run_rng(mode):
    """Device RNG: seeded streams repeat, random in-place ops write only their view."""
    import tpudist.device  # noqa: F401

    out = {}
    with torch.tpu.eager_mode(mode):
        def draw():
            x = torch.zeros(4, 5, device="tpu")
            x[1:, ::2].uniform_(2.0, 3.0)
            x[0].normal_()
            y = torch.empty(6, device="tpu").bernoulli_(0.5)
            return torch.cat([x.flatten(), y, torch.rand(3, device="tpu")]).cpu()

        torch.manual_seed(5)
        a = draw()
        state = torch.tpu.get_rng_state()
        b = draw()
        torch.manual_seed(5)
        c = draw()
        torch.tpu.set_rng_state(state)
        d = draw()
    out["repeat"] = torch.equal(a, c) and torch.equal(b, d) and not torch.equal(a, b)
    grid = a[:20].view(4, 5)
    out["view_only"] = (bool((grid[1:, 1::2] == 0).all()), bool(((grid[1:, ::2] >= 2) & (grid[1:, ::2] < 3)).all()))
    out["bernoulli"] = sorted(set(a[20:26].tolist())) <= [0.0, 1.0]
    return out


def _rrelu_with_noise_functional(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """torch's CPU rule: in training each element <= 0 draws its slope into noise, the others get 1."""
    import jax
    import jax.numpy as jnp

    import tpudist.ops as tops

    if not training:
        return jnp.where(x >= 0, x, x * ((lower + upper) / 2)), noise
    slopes = jax.random.uniform(tops.next_key(), x.shape, x.dtype, lower, upper)
    noise = jnp.where(x <= 0, slopes, 1).astype(noise.dtype)
    return x * noise, noise


def run_rrelu_noise(mode):
    """rrelu_with_noise(self, noise(b!)) in training writes the slopes it drew into noise: a random op
    that is neither in-place nor out=. tpudist has no lowering of its functional twin (a clear error);
    the test registers one to exercise the device's write-back."""
    import tpudist.device  # noqa: F401
    import tpudist.ops as tops

    op = torch.ops.aten.rrelu_with_noise.default
    twin = torch.ops.aten.rrelu_with_noise_functional.default
    error = None
    with torch.tpu.eager_mode(mode):
        x = torch.tensor([-2.0, -1.0, 0.5, 3.0, -4.0, 2.0]).to("tpu")
        noise = torch.zeros(6, device="tpu")
        if tops.lowering_for(twin) is None:
            try:
                op(x, noise, 0.1, 0.3, True)
            except NotImplementedError as e:
                error = str(e)
            tops.lowers(twin)(_rrelu_with_noise_functional)
        y = op(x, noise, 0.1, 0.3, True)
        return error, x.cpu(), noise.cpu(), y.cpu()


def _fallback_ops():
    lib = torch.library.Library("tpudist_semtest", "DEF")
    lib.define("bump(Tensor(a!) x, Tensor y) -> ()")
    lib.define("sneaky(Tensor x) -> Tensor")  # writes x without declaring it

    def bump(x, y):
        x.add_(y.sum())

    def sneaky(x):
        x.mul_(2)
        return x + 1

    lib.impl("bump", bump, "CPU")
    lib.impl("bump", lambda x, y: None, "Meta")
    lib.impl("sneaky", sneaky, "CPU")
    lib.impl("sneaky", lambda x: torch.empty_like(x), "Meta")
    return lib


def run_fallback_writes():
    """A mutating op with no functional twin: a clear error, or (with the CPU fallback) its writes,
    also through aliased arguments, declared or not."""
    import tpudist.device  # noqa: F401

    global _LIB
    _LIB = _LIB or _fallback_ops()  # a library defines its ops once per process
    ops = torch.ops.tpudist_semtest
    out = {}
    x = torch.arange(6.0).to("tpu")
    try:
        ops.bump(x, x[1:3])
        out["error"] = None
    except NotImplementedError as e:
        out["error"] = str(e)
    out["untouched"] = x.cpu()
    import warnings

    torch.tpu.set_cpu_fallback(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mode in MODES:
                with torch.tpu.eager_mode(mode):
                    ref, t = torch.arange(6.0), torch.arange(6.0).to("tpu")
                    ops.bump(ref, ref[1:3])
                    ops.bump(t, t[1:3])
                    ref2, t2 = torch.arange(4.0), torch.arange(4.0).to("tpu")
                    r, g = ops.sneaky(ref2[1:]), ops.sneaky(t2[1:])
                    out[mode] = ((ref, ref2, r), _host((t, t2, g)))
    finally:
        torch.tpu.set_cpu_fallback(False)
    return out


_LIB = None


def run_mutating_schemas():
    """Every aten overload whose schema writes a tensor argument: its functional twin on the device."""
    import tpudist.device  # noqa: F401
    from tpudist.device import _core

    twins, missing, other = {}, [], []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):  # noqa: SLF001 - every registered op
        namespace, _, name = qualified.partition("::")
        if namespace != "aten":
            continue
        packet_name, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        written = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]  # noqa: SLF001
        if not written or not all("Tensor" in str(a.type) for a in written):
            continue
        try:
            twins[str(op)] = str(_core.functional_twin(op))
        except _core.NoFunctionalTwin:
            missing.append(str(op))
        except Exception as e:  # noqa: BLE001 - reported by the test
            other.append((str(op), repr(e)))
    return twins, missing, other


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_to_device_keeps_tied_parameters_one_object(dev, mode):
    out = dev(run_module_identity, mode)
    assert out["tied"] and out["same_object"], out
    assert out["counts"] == out["cpu_counts"] == (3, 4, 3), out  # the tie counts once, twice without dedup
    assert out["grad"] == ("tpu", True)
    assert out["grad_accumulates"]
    assert out["buffers"] == ["tpu"]
    assert out["state_dict_keys"][0] == out["state_dict_keys"][1]
    assert out["loaded"] == (True, True)
    assert out["deepcopy"] == (True, "tpu", True)
    assert out["data_assign"] == ("tpu", True, [2.0, 2.0, 2.0])
    assert out["data_back"] == ("cpu", [0.0, 0.0])
    assert out["opt_before_to"] <= 1e-6
    assert out["round_trip"] == (True, "cpu", True, True, "cpu")
    assert out["swap"] == (True, "tpu")


@pytest.mark.parametrize("mode,optimizer_before_to", [("debug", False), ("strict", True), ("fused", False),
                                                      ("fused", True)])
def test_tied_model_adamw_matches_cpu(dev, mode, optimizer_before_to):
    ref, got, counts, state_counts, cpu_params, params = dev(run_tied_training, mode, optimizer_before_to)
    assert counts[0] == counts[1], counts  # the LM head and the embedding are one parameter on both
    assert state_counts[0] == state_counts[1], state_counts
    for step, (r, g) in enumerate(zip(ref, got)):
        assert abs(r - g) <= 1e-5 * abs(r), (mode, step, r, g)
    assert ref[-1] < ref[0]
    assert sorted(params) == sorted(cpu_params)
    for name, p in cpu_params.items():
        assert torch.allclose(params[name], p.detach(), rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_running_stats_match_cpu(dev, mode):
    results = dev(run_batch_norm, mode)
    assert sorted(results) == sorted(name for name, *_ in _bn_cases())
    for name, (ref, got) in results.items():
        (ref_outs, ref_grads, ref_state, ref_pgrads), (outs, grads, state, pgrads) = ref, got
        rtol, atol = (2e-2, 2e-2) if "bf16" in name else (1e-5, 1e-4)  # bf16: a rounding of the values
        assert sorted(state) == sorted(ref_state), name
        for key, value in ref_state.items():
            assert state[key].dtype == value.dtype, (name, key, state[key].dtype, value.dtype)
            if key == "num_batches_tracked":
                assert torch.equal(state[key], value), (name, state[key], value)
            else:
                assert torch.allclose(state[key], value, rtol=rtol, atol=atol / 100), (name, key, state[key], value)
        for what, a, b in (("out", outs, ref_outs), ("grad_input", grads, ref_grads), ("grad_params", pgrads, ref_pgrads)):
            assert _max_diff(a, b) <= atol * max(1.0, _max_abs(b)), (name, what, _max_diff(a, b))
        if "running_mean" in ref_state:
            assert ref_state["running_mean"].abs().sum() > 0  # the case does move the statistics


@pytest.mark.parametrize("mode", MODES)
def test_backward_with_masked_gradients_runs_as_programs(dev, mode):
    # convolution_backward returns None for an input that needs no gradient (it ran op by op outside
    # any program before); native_batch_norm_backward's lowering leaves it out (it raised before);
    # indexing's backward writes with _index_put_impl_ (no lowering before)
    for name, (diff, concrete) in dev(run_masked_backward, mode).items():
        assert diff <= 1e-4, (name, diff)  # a conv weight gradient sums 100s of products: 3e-5 seen
        assert concrete == 0, (name, f"{concrete} ops ran concretely")


@pytest.mark.parametrize("mode", MODES)
def test_mutating_ops_write_back(dev, mode):
    results, fallback = dev(run_mutations, mode)
    assert len(results) == len(_mutation_cases())
    for name, ref, got in results:
        for r, g in zip(_leaves(ref), _leaves(got)):
            assert r.shape == g.shape and r.dtype == g.dtype, (mode, name, r, g)
            assert torch.allclose(r, g, rtol=1e-5, atol=1e-5), (mode, name, r, g)
    assert fallback == {}


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_states_match_cpu(dev, mode):
    results = dev(run_optimizers, mode)
    for name, (ref, got) in results.items():
        (ref_params, ref_state), (params, state) = ref, got
        assert [sorted(s) for s in state] == [sorted(s) for s in ref_state], name
        assert _max_diff(params, ref_params) <= 1e-5, (mode, name, _max_diff(params, ref_params))
        assert _max_diff(state, ref_state) <= 1e-5, (mode, name, _max_diff(state, ref_state))


@pytest.mark.parametrize("mode", MODES)
def test_rng_in_place_ops_repeat_and_write_their_view(dev, mode):
    out = dev(run_rng, mode)
    assert out == {"repeat": True, "view_only": (True, True), "bernoulli": True}, out


@pytest.mark.parametrize("mode", MODES)
def test_random_mutating_op_writes_its_argument(dev, mode):
    error, x, noise, y = dev(run_rrelu_noise, mode)
    assert error is None or "rrelu_with_noise_functional" in error, error
    negative = x < 0
    assert torch.all(noise[~negative] == 1), noise
    assert torch.all((noise[negative] >= 0.1) & (noise[negative] <= 0.3)), noise
    assert torch.allclose(y, x * noise), (x, noise, y)


def test_cpu_fallback_writes_back_what_the_op_wrote(dev):
    out = dev(run_fallback_writes)
    assert "writes into its arguments and has no functional twin" in out["error"], out["error"]
    assert "set_cpu_fallback(True)" in out["error"]
    assert torch.equal(out["untouched"], torch.arange(6.0))
    for mode in MODES:
        ref, got = out[mode]
        for r, g in zip(_leaves(ref), _leaves(got)):
            assert torch.equal(r, g), (mode, r, g)


def test_every_mutating_schema_has_a_twin_or_a_clear_error(dev):
    twins, missing, other = dev(run_mutating_schemas)
    assert other == []
    assert len(twins) > 900, len(twins)
    for op, twin in {"aten._native_batch_norm_legit.default": "aten._native_batch_norm_legit_functional.default",
                     "aten._batch_norm_with_update.default": "aten._batch_norm_with_update_functional.default",
                     "aten.rrelu_with_noise.default": "aten.rrelu_with_noise_functional.default",
                     "aten.rrelu_with_noise_.default": "aten.rrelu_with_noise_functional.default",
                     "aten._native_batch_norm_legit.out": "aten._native_batch_norm_legit_functional.default",
                     "aten.embedding_renorm_.default": "aten.embedding_renorm.default",
                     "aten._fused_adamw_.default": "aten._fused_adamw.default",
                     "aten.add_.Tensor": "aten.add.Tensor", "aten.add.out": "aten.add.Tensor"}.items():
        assert twins.get(op) == twin, (op, twins.get(op))
    assert "aten._flash_attention_forward_no_dropout_inplace.default" in missing


def test_decomposition_writing_an_undeclared_argument_raises():
    """tops.call of native_batch_norm in training: torch's decomposition updates running_mean, which the
    schema does not declare and the caller cannot receive, so it must not silently drop it."""
    import jax.numpy as jnp

    import tpudist.ops as tops

    x, rm, rv = jnp.ones((4, 3)), jnp.zeros(3), jnp.ones(3)
    with pytest.raises(tops.UnsupportedOp, match="does not declare"):
        tops.call(torch.ops.aten.native_batch_norm.default, x, None, None, rm, rv, True, 0.1, 1e-5)
