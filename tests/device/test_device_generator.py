"""``torch.Generator(device="tpu")``: a random stream of its own for random ops on the device.

User code (diffusion pipelines among it) writes ``torch.Generator(device=device).manual_seed(s)`` and
passes ``generator=g`` to ``randn``/``rand``/``randint``/``normal_``/``multinomial``/``randperm``. The
device's C++ hooks make the generator (``getNewGenerator``); an op given one draws the key
``fold_in(key(seed), k)`` for the k-th op drawn from it, as the default stream does for its own counter.
The numbers cannot equal CPU's (another RNG); what is checked is what can be wrong: the same seed gives
the same values, another seed others, the default stream does not move, Strict and Fused agree, a saved
state replays, the distributions are right, and a generator of another device raises (as CUDA's ops do).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import tpudist.device  # noqa: F401

pytestmark = pytest.mark.skipif(not tpudist.device._hooks.active(),  # noqa: SLF001
                                reason="tpu generators need the device's C++ hooks (test_device_cpp_hooks.py)")


def _tpu(seed: int) -> torch.Generator:
    return torch.Generator(device="tpu").manual_seed(seed)


# each draws with generator=g; shapes small except where a distribution is checked
_OPS = {
    "randn": lambda g: torch.randn(5, 3, device="tpu", generator=g),
    "randn_bf16": lambda g: torch.randn(7, device="tpu", generator=g, dtype=torch.bfloat16),
    "rand": lambda g: torch.rand(9, device="tpu", generator=g),
    "randint_low_high": lambda g: torch.randint(-5, 100, (9,), device="tpu", generator=g),
    "randint_high": lambda g: torch.randint(100, (9,), device="tpu", generator=g),
    "normal_": lambda g: torch.empty(9, device="tpu").normal_(2.0, 3.0, generator=g),
    "normal_float_float": lambda g: torch.normal(0.0, 1.0, (9,), device="tpu", generator=g),
    "normal_tensor_tensor": lambda g: torch.normal(torch.zeros(9, device="tpu"), torch.ones(9, device="tpu"),
                                                   generator=g),
    "uniform_": lambda g: torch.empty(9, device="tpu").uniform_(-1.0, 1.0, generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((16,), 0.5, device="tpu"), generator=g),
    "bernoulli_": lambda g: torch.empty(16, device="tpu").bernoulli_(0.5, generator=g),
    "exponential_": lambda g: torch.empty(9, device="tpu").exponential_(generator=g),
    "random_": lambda g: torch.empty(9, device="tpu").random_(0, 1000, generator=g),
    "randperm": lambda g: torch.randperm(12, device="tpu", generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(12, device="tpu"), 6, generator=g),
    "multinomial_replacement": lambda g: torch.multinomial(torch.ones(12, device="tpu"), 6, replacement=True,
                                                           generator=g),
    "poisson": lambda g: torch.poisson(torch.full((16,), 3.0, device="tpu"), g),  # the generator positional
}


def test_a_tpu_generator_keeps_a_seed_and_an_offset_and_its_state_round_trips():
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0)
    assert g.initial_seed() == torch.Generator().initial_seed()  # torch's default seed, as CPU's and CUDA's
    assert g.manual_seed(7) is g and g.initial_seed() == 7 and g.get_offset() == 0
    torch.randn(3, device="tpu", generator=g)
    torch.rand(3, device="tpu", generator=g)
    assert g.get_offset() == 2  # one per op drawn
    state = g.get_state()
    assert (state.dtype, state.device, state.view(torch.int64).tolist()) == (torch.uint8, torch.device("cpu"), [7, 2])
    other = torch.Generator(device="tpu")
    other.set_state(state)
    assert (other.initial_seed(), other.get_offset()) == (7, 2)
    assert g.clone_state().get_state().equal(state)
    new_seed = g.seed()
    assert g.initial_seed() == new_seed and g.get_offset() == 0
    assert g.manual_seed(7).get_offset() == 0  # a seed restarts the stream
    with pytest.raises(RuntimeError, match="16 bytes"):
        other.set_state(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(TypeError, match="ByteTensor"):
        other.set_state(torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("name", sorted(_OPS))
def test_an_op_draws_from_its_generator_alone(name):
    draw = _OPS[name]
    torch.manual_seed(0)
    default_state = torch.tpu.get_rng_state()
    g = _tpu(1)
    first = draw(g).cpu()
    assert torch.tpu.get_rng_state().equal(default_state), "the default stream moved"
    assert g.get_offset() == 1
    assert draw(_tpu(1)).cpu().equal(first)
    assert not draw(_tpu(2)).cpu().equal(first)
    assert not draw(g).cpu().equal(first)  # the generator's next op gets the next key
    torch.manual_seed(1)  # a generator seeded s draws what the default stream seeded s draws (so does CUDA)
    assert draw(None).cpu().equal(first)


@pytest.mark.parametrize("name", ["randn", "randint_low_high", "normal_", "bernoulli_", "randperm", "multinomial",
                                  "poisson"])
def test_strict_and_fused_draw_the_same_numbers(name):
    got = {}
    previous = torch.tpu.get_eager_mode()
    try:
        for mode in ("strict", "fused"):
            torch.tpu.set_eager_mode(mode)
            g = _tpu(3)
            got[mode] = [_OPS[name](g).cpu() for _ in range(2)]
    finally:
        torch.tpu.set_eager_mode(previous)
    for strict, fused in zip(got["strict"], got["fused"]):
        assert strict.equal(fused)


def test_the_generator_and_the_default_stream_do_not_disturb_each_other():
    g = _tpu(5)
    alone = [torch.randn(4, device="tpu", generator=g).cpu() for _ in range(3)]
    torch.manual_seed(9)
    default_alone = [torch.randn(4, device="tpu").cpu() for _ in range(3)]
    g = _tpu(5)
    torch.manual_seed(9)
    mixed, default_mixed = [], []
    for _ in range(3):
        mixed.append(torch.randn(4, device="tpu", generator=g).cpu())
        default_mixed.append(torch.randn(4, device="tpu").cpu())
        torch.nn.functional.dropout(torch.ones(4, device="tpu"), 0.5)  # the default stream, inside a module op
    for a, b in zip(alone, mixed):
        assert a.equal(b)
    assert default_alone[0].equal(default_mixed[0]) and not default_alone[1].equal(default_mixed[1])  # dropout drew
    torch.manual_seed(9)
    assert torch.randn(4, device="tpu").cpu().equal(default_mixed[0])


def test_a_saved_state_replays_the_stream():
    g = _tpu(11)
    torch.rand(2, device="tpu", generator=g)
    state = g.get_state()
    first = [torch.randn(3, device="tpu", generator=g).cpu(), torch.randperm(6, device="tpu", generator=g).cpu()]
    g.set_state(state)
    again = [torch.randn(3, device="tpu", generator=g).cpu(), torch.randperm(6, device="tpu", generator=g).cpu()]
    assert first[0].equal(again[0]) and first[1].equal(again[1])
    g.set_offset(1)  # what get_state saved: seed 11, one op drawn
    assert torch.randn(3, device="tpu", generator=g).cpu().equal(first[0])


def test_distributions_of_a_large_draw():
    g = _tpu(123)
    n = 200_000
    normal = torch.randn(n, device="tpu", generator=g).cpu().double()
    assert abs(normal.mean().item()) < 0.01 and abs(normal.var().item() - 1) < 0.02
    shifted = torch.empty(n, device="tpu").normal_(2.0, 3.0, generator=g).cpu().double()
    assert abs(shifted.mean().item() - 2) < 0.03 and abs(shifted.std().item() - 3) < 0.03
    uniform = torch.rand(n, device="tpu", generator=g).cpu().double()
    assert 0 <= uniform.min().item() and uniform.max().item() < 1
    assert abs(uniform.mean().item() - 0.5) < 0.005 and abs(uniform.var().item() - 1 / 12) < 0.002
    ints = torch.randint(-3, 5, (n,), device="tpu", generator=g).cpu()
    assert ints.dtype == torch.int64 and set(ints.unique().tolist()) == set(range(-3, 5))
    assert (torch.bincount(ints + 3).double() / n - 1 / 8).abs().max().item() < 0.005
    coins = torch.bernoulli(torch.full((n,), 0.25, device="tpu"), generator=g).cpu()
    assert abs(coins.mean().item() - 0.25) < 0.005
    picks = torch.multinomial(torch.tensor([1.0, 2.0, 7.0], device="tpu"), n, replacement=True, generator=g).cpu()
    assert (torch.bincount(picks).double() / n - torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)).abs().max() < 0.005
    rates = torch.tensor([0.0, 0.5, 3.0, 40.0])
    counts = torch.poisson(rates.to("tpu").expand(n, 4), g).cpu().double()
    reference = torch.poisson(rates.expand(n, 4), torch.Generator().manual_seed(0)).double()  # CPU eager's law
    assert counts.dtype == reference.dtype and bool((counts == counts.round()).all()) and counts.min().item() >= 0
    assert (counts[:, 0] == 0).all()
    for stat in (torch.mean, torch.var):  # Poisson(r): mean r, variance r; 5 standard errors of the two draws
        assert ((stat(counts, 0) - stat(reference, 0)).abs() <= 5 * (4 * rates + 1) / n ** 0.5).all(), stat
    assert sorted(torch.randperm(1000, device="tpu", generator=g).cpu().tolist()) == list(range(1000))


def test_a_generator_of_another_device_raises_as_on_cuda():
    torch.manual_seed(0)
    state = torch.tpu.get_rng_state()
    cpu = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.randn(3, device="tpu", generator=cpu)
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.ones(3, device="tpu").normal_(generator=cpu)
    assert torch.tpu.get_rng_state().equal(state)
    assert cpu.get_state().equal(torch.Generator().manual_seed(1).get_state())
    with pytest.raises(RuntimeError):  # torch's own check, for the mirror case
        torch.randn(3, generator=_tpu(1))


def test_an_op_run_by_the_cpu_fallback_refuses_the_generator(monkeypatch):
    """The CPU fallback runs an op on CPU's stream: with a tpu generator that raises, never CPU's numbers."""
    import tpudist.ops as tops
    from tpudist.device import _execute

    def no_lowering(op, *_args):
        raise tops.UnsupportedOp(op, " (this test: as if it had no lowering)")

    torch.tpu.set_cpu_fallback(True)
    try:
        x, rates = torch.zeros(13, device="tpu"), torch.full((4,), 3.0, device="tpu")
        with monkeypatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's own warning, once per op and process
            patch.setattr(_execute, "_KERNELS", {})
            patch.setattr(_execute, "_resolve", no_lowering)
            assert x.clone().normal_().device.type == "tpu"  # the fallback itself works
            with pytest.raises(NotImplementedError, match="ran without drawing from the generator"):
                x.clone().normal_(generator=_tpu(1))
            # an op taking its generator positionally (poisson): torch's CPU kernel refuses the tpu generator
            with pytest.raises(RuntimeError, match="Expected a 'cpu' device type"):
                torch.poisson(rates, _tpu(1))
    finally:
        torch.tpu.set_cpu_fallback(False)


def test_an_op_taking_its_generator_positionally_draws_from_it():
    """``rrelu_with_noise`` (RReLU in training) has ``generator`` in its positional arguments."""
    rrelu = torch.ops.aten.rrelu_with_noise.default
    x = torch.randn(32, device="tpu")

    def draw(g):
        return rrelu(x, torch.empty(32, device="tpu"), 0.1, 0.3, True, g).cpu()

    torch.manual_seed(0)
    default_state = torch.tpu.get_rng_state()
    g = _tpu(1)
    first = draw(g)
    assert g.get_offset() == 1 and torch.tpu.get_rng_state().equal(default_state)
    assert draw(_tpu(1)).equal(first) and not draw(_tpu(2)).equal(first)
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        draw(torch.Generator())


def test_a_compiled_function_draws_from_the_generator():
    """dynamo does not put a generator argument in a graph: it breaks the graph there, and the op runs on the
    device with the generator."""
    g = torch.Generator(device="tpu")

    def noisy(x):
        return x * 2 + torch.randn(x.shape, device=x.device, generator=g)

    x = torch.arange(4.0, device="tpu")
    compiled = torch.compile(noisy, backend="tpudist")
    torch.manual_seed(0)
    default_state = torch.tpu.get_rng_state()
    g.manual_seed(3)
    got = compiled(x).cpu()
    assert torch.tpu.get_rng_state().equal(default_state)
    g.manual_seed(3)
    assert got.equal(noisy(x).cpu())
    g.manual_seed(4)
    assert not compiled(x).cpu().equal(got)


# -- the default stream: the hooks' getDefaultGenerator ----------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "fused"], indirect=True)
def test_the_default_stream_is_the_devices_default_generator(mode):
    """``torch.tpu.default_generators[0]`` (as ``torch.cuda.default_generators[0]``) is the stream random ops
    without ``generator=`` draw from: ``torch.manual_seed``/``torch.tpu.manual_seed`` seed it, its state is
    ``torch.tpu.get_rng_state()``, and it draws what a tpu generator of the same seed draws."""
    (g,) = torch.tpu.default_generators
    assert isinstance(g, torch.Generator) and g.device == torch.device("tpu", 0)
    assert torch.tpu.default_generators[0] is g
    torch.manual_seed(11)
    assert (g.initial_seed(), g.get_offset(), torch.tpu.initial_seed()) == (11, 0, 11)
    first = [torch.randn(4, device="tpu").cpu(), torch.randint(0, 100, (5,), device="tpu").cpu()]
    assert g.get_offset() == 2
    assert torch.tpu.get_rng_state().equal(g.get_state())
    mine = _tpu(11)
    assert torch.randn(4, device="tpu", generator=mine).cpu().equal(first[0])
    assert torch.randint(0, 100, (5,), device="tpu", generator=mine).cpu().equal(first[1])
    g.manual_seed(11)  # seeding the generator is seeding the default stream
    assert torch.randn(4, device="tpu").cpu().equal(first[0])
    torch.tpu.manual_seed(12)
    assert g.initial_seed() == 12 and not torch.randn(4, device="tpu").cpu().equal(first[0])
    torch.tpu.seed()
    assert g.initial_seed() == torch.tpu.initial_seed() != 12 and g.get_offset() == 0


@pytest.mark.parametrize("mode", ["strict", "fused"], indirect=True)
def test_fork_rng_and_saved_states_restore_the_default_stream(mode):
    torch.manual_seed(3)
    torch.rand(2, device="tpu")
    state = torch.tpu.get_rng_state()
    with torch.random.fork_rng(device_type="tpu"):
        inside = torch.randn(6, device="tpu").cpu()
        torch.tpu.manual_seed(99)
        torch.randn(6, device="tpu")
    assert torch.tpu.get_rng_state().equal(state)
    assert torch.randn(6, device="tpu").cpu().equal(inside)  # the stream went on from where the fork began
    torch.tpu.set_rng_state(state)
    assert torch.randn(6, device="tpu").cpu().equal(inside)
    assert state.view(torch.int64).tolist() == [3, 1]  # seed and the ops drawn (a tpu generator's 16 bytes)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.tpu.set_rng_state(torch.zeros(8, dtype=torch.uint8))


_FRESH = """
import torch, tpudist.device
unseeded = torch.randn(5, device="tpu").cpu()
print(torch.tpu.initial_seed(), torch.randn(5, device="tpu", generator=torch.Generator("tpu")).cpu().equal(unseeded))
"""


def test_an_unseeded_process_starts_from_torchs_default_seed():
    """As on CPU and CUDA: an unseeded default stream has torch's default seed, so it draws what a new
    generator draws."""
    result = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(torch.Generator().initial_seed()), "True"]


def test_negative_poisson_rates_raise_in_debug_mode():
    """torch's CPU kernel refuses a negative (or NaN) rate; Debug mode makes that data-dependent check
    with torch's message, Strict draws -1 there (docs/device.md's limits)."""
    rates = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(RuntimeError, match="expected rate to be non-negative"):
        torch.poisson(rates)
    with torch.tpu.eager_mode("debug"):
        for bad in (rates, torch.tensor([float("nan"), 1.0])):
            with pytest.raises(RuntimeError, match="expected rate to be non-negative.*found (-2|nan)"):
                torch.poisson(bad.to("tpu"))
        assert torch.poisson(torch.tensor([0.0, 2.0]).to("tpu")).cpu()[0] == 0
    with torch.tpu.eager_mode("strict"):
        assert torch.poisson(rates.to("tpu")).cpu()[1] == -1
