"""torch's float32 matmul precision on every path that traces a program (``tpudist.matmul_precision``):
Strict, Fused, ``torch.compile(backend="tpu")``, ``custom_jax_kernel``, ``tpudist.sharding.spmd``.

XLA:CPU multiplies float32 exactly at every precision, so on CPU the programs themselves are checked:
JAX writes each module it lowers to a folder (``jax_dump_ir_to``), and every dot_general and
convolution in them must carry the XLA precision of torch's setting ("highest" -> HIGHEST, "high" ->
HIGH, "medium" -> DEFAULT, which StableHLO may leave unwritten). Switching the setting must run the
other program, from memory and from the on-disk program cache: spies note the precision of each
program that runs. The tests run in one worker process with its own cache folder, so no program of
another test module or an earlier run is loaded without being lowered. The chip's numbers:
tests/device/test_device_matmul_precision_tpu.py.
"""

from __future__ import annotations

import re
import tempfile

import jax
import jax.numpy as jnp
import pytest
import torch

from tpudist import matmul_precision
from tpudist.testing import RankPool

SETTINGS = ("highest", "high", "medium")
XLA = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tpudist_cache")
    env = {"TPUDIST_EAGER_MODE": "strict", "TPUDIST_CACHE_DIR": str(cache)}
    with RankPool(1, backend="tpu", timeout=600, env=env) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- reading programs ------------------------------------------------------------------------------

_PRODUCT = re.compile(r"stablehlo\.(dot_general|convolution)")
_PRECISION = re.compile(r"precision = \[(\w+)|#stablehlo<precision (\w+)>")
_OPERANDS = re.compile(r": \(tensor<([^>]*)>, tensor<([^>]*)>\) ->")


def products(text: str) -> list[tuple[str, int, int]]:
    """(XLA precision, lhs rank, rhs rank) of each dot_general and convolution in a StableHLO text."""
    found = []
    for line in text.splitlines():
        if not _PRODUCT.search(line):
            continue
        precision = _PRECISION.search(line)
        lhs, rhs = _OPERANDS.search(line).groups()
        found.append((next(p for p in precision.groups() if p) if precision else "DEFAULT",
                      lhs.count("x"), rhs.count("x")))
    return found


class Lowered:
    """The products of every module JAX lowers inside ``with Lowered() as lowered:``."""

    def __enter__(self):
        self.folder = tempfile.mkdtemp()
        jax.config.update("jax_dump_ir_to", self.folder)
        return self

    def __exit__(self, *exc):
        jax.config.update("jax_dump_ir_to", "")

    def products(self) -> list[tuple[str, int, int]]:
        """Of matrix operands only: reductions' products with a vector of ones pin HIGHEST (CPU only)."""
        from pathlib import Path

        return [p for path in sorted(Path(self.folder).glob("*.mlir")) for p in products(path.read_text())
                if p[1] >= 2]


def test_products_reads_dots_and_convolutions():
    """The parser against JAX's own text, written at each precision: it must tell them apart."""
    a, x, w = jnp.ones((2, 4, 4)), jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))

    def both(a, x, w):
        return jnp.einsum("bij,bjk->bik", a, a), jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    for name, xla in [("highest", "HIGHEST"), ("high", "HIGH"), ("default", "DEFAULT")]:
        with jax.default_matmul_precision(name):
            text = jax.jit(both).lower(a, x, w).as_text()
        assert products(text) == [(xla, 3, 3), (xla, 4, 4)], name


# -- the mapping -----------------------------------------------------------------------------------

def test_jax_jit_keys_its_programs_by_the_matmul_precision():
    """What Strict mode and the kernels rely on (jax 0.10.2: include_in_jit_key): a jitted function
    is traced again for a new precision, and not for one it has seen."""
    traces = []

    @jax.jit
    def f(a):
        traces.append(1)
        return a @ a

    a = jnp.ones((3, 3))
    for name in ("highest", "default", "highest", "high", "default"):
        with jax.default_matmul_precision(name):
            f(a)
    assert len(traces) == 3


def test_torch_settings_map_to_xla_precisions(monkeypatch):
    previous = torch.get_float32_matmul_precision()
    try:
        for setting in SETTINGS:
            torch.set_float32_matmul_precision(setting)
            assert matmul_precision.current() == setting
            a = jnp.ones((3, 3))
            with matmul_precision.scope(setting):
                text = jax.jit(lambda a: a @ a).lower(a).as_text()
            assert [p for p, _, _ in products(text)] == [XLA[setting]]
    finally:
        torch.set_float32_matmul_precision(previous)
    with pytest.raises(ValueError, match=r"precision='tf32' has no XLA equivalent.*'medium': 'default'"):
        matmul_precision.jax_name("tf32")

    def refuses():
        raise RuntimeError("PyTorch is checking the matmul precision without a specific backend name")

    monkeypatch.setattr(matmul_precision, "_read", refuses)
    with pytest.raises(RuntimeError, match=r"torch refused: PyTorch is checking.*set_float32_matmul_precision"):
        matmul_precision.current()


# -- the device: every op kind, each mode and setting -----------------------------------------------

def _suite(device: str) -> dict:
    """float32 products of every kind a model runs, with a backward; their values on the host."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        x = torch.randn(*shape, generator=g).to(device)
        return x.requires_grad_() if grad else x

    x, w, bias = t(4, 6, grad=True), t(5, 6, grad=True), t(5, grad=True)
    a, b, c = t(2, 4, 6), t(2, 6, 3), t(2, 4, 3)
    img, kernel = t(1, 2, 6, 6, grad=True), t(3, 2, 3, 3, grad=True)
    q, k, v = t(1, 2, 4, 8, grad=True), t(1, 2, 4, 8, grad=True), t(1, 2, 4, 8, grad=True)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32).to(device)
    outs = {
        "mm": torch.mm(a[0], b[0]), "addmm": torch.addmm(c[0], a[0], b[0]), "bmm": torch.bmm(a, b),
        "baddbmm": torch.baddbmm(c, a, b), "matmul": torch.matmul(a[None], b[None]),
        "einsum": torch.einsum("bij,bjk->bik", a, b), "linear": F.linear(x, w, bias),
        "conv2d": F.conv2d(img, kernel, padding=1), "sdpa": F.scaled_dot_product_attention(q, k, v),
        "grouped_mm": torch._grouped_mm(t(10, 8), t(3, 8, 8), offs=offs),
    }
    (outs["linear"].sum() + outs["conv2d"].square().sum() + outs["sdpa"].square().sum()).backward()
    grads = {f"grad {name}": p.grad for name, p in [("x", x), ("w", w), ("img", img), ("kernel", kernel),
                                                    ("q", q), ("k", k), ("v", v)]}
    return {name: value.detach().cpu() for name, value in {**outs, **grads}.items()}


def run_suite(mode: str, setting: str):
    """(the products of the programs the suite lowered, its values on the device and on the CPU)."""
    import tpudist.device  # noqa: F401

    previous = torch.tpu.get_eager_mode()
    torch.tpu.set_eager_mode(mode)
    torch.set_float32_matmul_precision(setting)
    try:
        with Lowered() as lowered:
            on_device = _suite("tpu")
        return lowered.products(), on_device, _suite("cpu")
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.tpu.set_eager_mode(previous)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_every_product_takes_the_setting(dev, mode, setting):
    """mm, addmm, bmm, baddbmm, matmul, einsum, linear, conv2d, SDPA and grouped_mm, forward and
    backward: each dot and convolution of the programs the device lowered has the setting's precision."""
    found, on_device, on_cpu = dev(run_suite, mode, setting)
    precisions = sorted({p for p, _, _ in found})
    assert precisions == [XLA[setting]], found
    assert len(found) >= 15, found  # 10 forwards and the backward's products (Fused fuses none away)
    for name, want in on_cpu.items():
        torch.testing.assert_close(on_device[name], want, rtol=1e-4, atol=1e-5, msg=name)


# -- switching: the next op runs the other program ---------------------------------------------------

def _precision_of_compiled(compiled) -> str:
    """The dot precision XLA compiled (its HLO names HIGHEST and HIGH; DEFAULT is left out)."""
    found = re.search(r"operand_precision=\{(\w+),", compiled.as_text())
    return found.group(1).upper() if found else "DEFAULT"


def _spy_on_strict_mm(ran: list):
    """Note, at each call of a Strict mm kernel, the precision jax.jit picks its program by."""
    from tpudist.device import _core

    by_jax_name = {v: k for k, v in matmul_precision.JAX_NAMES.items()}
    for kernel in list(_core._KERNELS.values()):  # noqa: SLF001
        if getattr(kernel, "op", None) is torch.ops.aten.mm.default:
            jitted = kernel.__dict__.setdefault("unspied", kernel.jitted_plain)

            def spy(arrays, jitted=jitted):
                ran.append(XLA[by_jax_name[matmul_precision.STATE.value]])
                return jitted(arrays)

            kernel.jitted_plain = spy


def _spy_on_fused_programs(ran: list):
    """Note the compiled precision of each Fused program built from now on, at each of its runs."""
    from tpudist.device import _fused

    build = getattr(_fused._load_or_compile, "unspied", _fused._load_or_compile)  # noqa: SLF001

    def spied(g, live, sc, shapes=None):
        compiled = build(g, live, sc, shapes)
        precision = _precision_of_compiled(compiled)

        def run(inputs, sc):
            ran.append(precision)
            return compiled(inputs, sc)

        return run

    spied.unspied = build
    _fused._load_or_compile = spied  # noqa: SLF001


def switching(mode: str, settings: tuple) -> tuple[list, list, list]:
    """(the precision of the program each x @ w ran, what was lowered per call, the values' errors)."""
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 7, generator=g), torch.randn(7, 2, generator=g)  # shapes no other test uses
    dx, dw = x.to("tpu"), w.to("tpu")
    ran, lowered_per_call, errors = [], [], []
    if mode == "fused":
        _spy_on_fused_programs(ran)
    try:
        for setting in settings:
            torch.set_float32_matmul_precision(setting)
            with Lowered() as lowered:
                out = (dx @ dw).cpu()
            lowered_per_call.append(sorted({p for p, _, _ in lowered.products()}))
            errors.append(float((out - x @ w).abs().max()))
            if mode == "strict":
                _spy_on_strict_mm(ran)  # wrapped after the first call built the kernel
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.tpu.set_eager_mode("strict")
    return ran, lowered_per_call, errors


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_switching_the_setting_switches_the_program(dev, mode):
    """Each setting is lowered once and reused after: no stale program in either direction."""
    settings = ("highest", "medium", "high", "highest", "medium", "high")
    ran, lowered, errors = dev(switching, mode, settings)
    assert lowered == [["HIGHEST"], ["DEFAULT"], ["HIGH"], [], [], []]
    want = [XLA[s] for s in settings]
    assert ran == (want[1:] if mode == "strict" else want)  # Strict's spy is in place from the second call
    assert max(errors) < 1e-5


def mid_graph_switch() -> dict:
    """Fused: a dot recorded at "highest", the setting changed, a dot and an add recorded, one sync."""
    import tpudist.device  # noqa: F401
    from tpudist.device import _runtime

    torch.tpu.set_eager_mode("fused")
    ran: list = []
    _spy_on_fused_programs(ran)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 9, generator=g), torch.randn(9, 9, generator=g)
    dx, dw = x.to("tpu"), w.to("tpu")
    syncs = _runtime.stats["syncs"]
    try:
        torch.set_float32_matmul_precision("highest")
        a = dx @ dw
        torch.set_float32_matmul_precision("medium")
        b = (a @ dw) + 1
        pending = torch.tpu.cache_stats()["pending_ops"]
        out = b.cpu()
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.tpu.set_eager_mode("strict")
    return {"ran": ran, "syncs": _runtime.stats["syncs"] - syncs, "pending": pending,
            "error": float((out - ((x @ w) @ w + 1)).abs().max())}


def test_fused_graph_runs_before_a_product_at_another_precision(dev):
    result = dev(mid_graph_switch)
    assert result["ran"] == ["HIGHEST", "DEFAULT"]
    assert result["syncs"] == 2 and result["pending"] == 2  # the second graph: the dot and the add
    assert result["error"] < 1e-4


def grown_cache_attention(mode: str, setting: str) -> dict:
    """A KV cache grown by ``cat`` two tokens a step and attended causally (``_grow``'s padded attention,
    read at the capacity): the products lowered, the largest difference from CPU."""
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401
    from tpudist.device import _grow, buckets

    previous = buckets.set_growth(buckets.Growth(multiple=8, max_buckets=2, per_octave=2))
    torch.tpu.set_eager_mode(mode)
    torch.set_float32_matmul_precision(setting)
    g = torch.Generator().manual_seed(5)
    k = v = torch.randn(1, 2, 3, 8, generator=g).to("tpu")
    errors = []
    try:
        with Lowered() as lowered:
            for _ in range(4):  # lengths 5, 7, 9, 11: capacities 8 and 16, each step a new shape
                k = torch.cat([k, torch.randn(1, 2, 2, 8, generator=g).to("tpu")], dim=2)
                v = torch.cat([v, torch.randn(1, 2, 2, 8, generator=g).to("tpu")], dim=2)
                q = torch.randn(1, 2, 2, 8, generator=g)
                out = F.scaled_dot_product_attention(q.to("tpu"), k, v, is_causal=True)
                errors.append(float((out.cpu() - F.scaled_dot_product_attention(q, k.cpu(), v.cpu(), is_causal=True))
                                    .abs().max()))
        kinds = sorted({type(kernel).__name__ for kernel in _grow._KERNELS.values()})  # noqa: SLF001
    finally:
        buckets.set_growth(previous)
        torch.set_float32_matmul_precision("highest")
        torch.tpu.set_eager_mode("strict")
    return {"products": lowered.products(), "kinds": kinds, "error": max(errors)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_grown_cache_products_take_the_setting(dev, mode, setting):
    """``_grow``'s attention over a cache's capacity is built outside ``_core``'s check, which tells the
    kernels with dots; its dots must take torch's setting all the same (on the chip, it ran at DEFAULT
    and missed CPU's result at 1e-5 where the attention at the exact length matched)."""
    result = dev(grown_cache_attention, mode, setting)
    assert "_PaddedAttention" in result["kinds"], result["kinds"]
    assert result["products"] and {p for p, _, _ in result["products"]} == {XLA[setting]}, result["products"]
    assert result["error"] < 1e-5


def cost_of_the_check() -> dict:
    """How often an op reads torch's setting: only kernels whose program holds a product do."""
    import tpudist.device  # noqa: F401

    reads = [0]
    read = matmul_precision.current

    def counted():
        reads[0] += 1
        return read()

    matmul_precision.current = counted
    counts = {}
    try:
        x = torch.randn(4, 4).to("tpu")
        for mode in ("strict", "fused"):
            torch.tpu.set_eager_mode(mode)
            for name, fn in [("add", lambda: x + x), ("mm", lambda: x @ x)]:
                fn()  # builds the kernel
                reads[0] = 0
                fn()
                counts[f"{mode} {name}"] = reads[0]
            torch.tpu.synchronize()
    finally:
        matmul_precision.current = read
        torch.tpu.set_eager_mode("strict")
    return counts


def test_only_products_read_the_setting(dev):
    assert dev(cost_of_the_check) == {"strict add": 0, "strict mm": 1, "fused add": 0, "fused mm": 1}


# -- the on-disk program cache ------------------------------------------------------------------------

def fused_from_disk() -> list:
    """A Fused graph run at "highest", then (its in-memory program forgotten) at "medium", then at
    "highest" again: [(compiled precision, loaded from disk)] per run."""
    import tpudist.device  # noqa: F401
    from tpudist.device import _fused, _runtime

    torch.tpu.set_eager_mode("fused")
    ran: list = []
    _spy_on_fused_programs(ran)
    x = torch.randn(6, 11).to("tpu")
    w = torch.randn(11, 3).to("tpu")
    runs = []
    try:
        for setting in ("highest", "medium", "highest"):
            torch.set_float32_matmul_precision(setting)
            _fused._PROGRAMS.clear()  # noqa: SLF001 - a later process: only the disk remembers
            loaded = _runtime.stats["programs_from_disk"]
            (torch.tanh(x) @ w).cpu()
            runs.append((ran[-1], _runtime.stats["programs_from_disk"] - loaded))
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.tpu.set_eager_mode("strict")
    return runs


def test_fused_disk_cache_keys_by_the_setting(dev):
    assert dev(fused_from_disk) == [("HIGHEST", 0), ("DEFAULT", 0), ("HIGHEST", 1)]


# -- torch.compile ------------------------------------------------------------------------------------

def compiled_switching() -> dict:
    """A compiled x @ w called across settings, then from the disk cache with Dynamo's and the
    backend's memory forgotten: the compiled precision of each call's program, and the counters."""
    from tpudist.compile import program

    ran = []
    run = program.GraphProgram._run  # noqa: SLF001

    def spy(self, arrays, key_data=None):
        ran.append(_precision_of_compiled(self._exe.compiled))  # noqa: SLF001
        return run(self, arrays, key_data)

    program.GraphProgram._run = spy  # noqa: SLF001
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g)
    fn = torch.compile(lambda x, w: x @ w, backend="tpu", dynamic=False)
    errors, graphs = [], program.STATS.graphs
    try:
        # Dynamo guards on cuBLAS's allow_tf32, which "high" and "medium" share: one graph serves both
        for setting in ("high", "medium", "high", "highest"):
            torch.set_float32_matmul_precision(setting)
            errors.append(float((fn(x, w) - x @ w).abs().max()))
        in_memory = {"ran": list(ran), "graphs": program.STATS.graphs - graphs}
        disk = []
        for setting in ("medium", "highest"):
            program.clear_cache()
            torch._dynamo.reset()  # noqa: SLF001
            torch.set_float32_matmul_precision(setting)
            hits = program.STATS.disk_hits
            fn(x, w)
            disk.append((ran[-1], program.STATS.disk_hits - hits))
    finally:
        torch.set_float32_matmul_precision("highest")
        program.GraphProgram._run = run  # noqa: SLF001
    return {**in_memory, "disk": disk, "error": max(errors)}


def test_compiled_graph_runs_the_program_of_each_call(dev):
    result = dev(compiled_switching)
    assert result["ran"] == ["HIGH", "DEFAULT", "HIGH", "HIGHEST"]
    assert result["graphs"] == 2  # high/medium share Dynamo's graph; "highest" is a recompile
    assert result["disk"] == [("DEFAULT", 1), ("HIGHEST", 1)]
    assert result["error"] < 1e-5


# -- custom_jax_kernel and spmd ---------------------------------------------------------------------

def kernel_programs() -> dict:
    """A custom_jax_kernel of a product on CPU tensors (its own jitted program), on tpu tensors (a
    device kernel) and compiled ahead of time: what each setting lowered."""
    import tpudist.device  # noqa: F401
    from tpudist.kernels import custom_jax_kernel

    @custom_jax_kernel("precision_test::product")
    def product(a, b):
        return a @ b

    a, b = torch.randn(4, 6), torch.randn(6, 2)
    found = {"cpu": [], "tpu": [], "compile": []}
    try:
        for setting in ("highest", "medium", "highest", "high"):
            torch.set_float32_matmul_precision(setting)
            with Lowered() as lowered:
                assert torch.allclose(product(a, b), a @ b, atol=1e-5)
            found["cpu"].append(sorted({p for p, _, _ in lowered.products()}))
            with Lowered() as lowered:
                assert torch.allclose(product(a.to("tpu"), b.to("tpu")).cpu(), a @ b, atol=1e-5)
            found["tpu"].append(sorted({p for p, _, _ in lowered.products()}))
            with Lowered() as lowered:
                product.compile(torch.empty(5, 3, device="meta"), torch.empty(3, 7, device="meta"))
            found["compile"].append(sorted({p for p, _, _ in lowered.products()}))
    finally:
        torch.set_float32_matmul_precision("highest")
    return found


def test_kernel_programs_take_the_setting(dev):
    found = dev(kernel_programs)
    fresh = [["HIGHEST"], ["DEFAULT"], [], ["HIGH"]]  # the second "highest" reuses its program
    assert found["cpu"] == fresh and found["tpu"] == fresh and found["compile"] == fresh


def spmd_programs() -> list:
    """tpudist.sharding.spmd of a product over a 1-rank mesh: what each setting lowered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from tpudist.sharding import spmd

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    a = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    b = distribute_tensor(torch.randn(6, 3), mesh, [Replicate()])
    product = spmd(lambda a, b: a @ b)
    found = []
    try:
        for setting in ("highest", "medium", "highest"):
            torch.set_float32_matmul_precision(setting)
            with Lowered() as lowered:
                out = product(a, b)
            assert torch.allclose(out.full_tensor(), a.full_tensor() @ b.full_tensor(), atol=1e-5)
            found.append(sorted({p for p, _, _ in lowered.products()}))
    finally:
        torch.set_float32_matmul_precision("highest")
    return found


def test_spmd_programs_take_the_setting(dev):
    assert dev(spmd_programs) == [["HIGHEST"], ["DEFAULT"], []]  # the second "highest" reuses its program
