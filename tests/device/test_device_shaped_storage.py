"""``TPUDIST_SHAPED_STORAGE=1``: a whole storage's N-d values stay N-d between programs (``Shaped``).

``.to("tpu")`` copies an N-d tensor N-d, Fused programs leave their N-d results so, compiled programs
read and leave every N-d value so: no parameter or gradient is reshaped flat and back at a program's edge
(on a TPU each such reshape is a copy). The values are the same either way: training matches CPU eager,
compiles its step once, and Strict (which reads storages flat) still works. Shapes of their own per test:
the process's programs are shared by every test of the folder.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from test_device_fused_blocks import _check_equal, _recipe, _train  # the recipe's model trained against CPU eager
from tpudist._switches import shaped_storage
from tpudist.device._storage import Shaped, buffer_of


@pytest.fixture
def shaped(monkeypatch):
    monkeypatch.setenv("TPUDIST_SHAPED_STORAGE", "1")


def _shaped_params(model) -> list[bool]:
    return [buffer_of(p).value.__class__ is Shaped for p in model.parameters() if p.dim() > 1]


def test_the_switch_is_off_by_default_and_checked(monkeypatch):
    monkeypatch.delenv("TPUDIST_SHAPED_STORAGE", raising=False)
    assert not shaped_storage()
    monkeypatch.setenv("TPUDIST_SHAPED_STORAGE", "yes")
    with pytest.raises(ValueError, match="TPUDIST_SHAPED_STORAGE='yes' must be '1'"):
        shaped_storage()


def test_to_device_copies_n_d_tensors_n_d(shaped):
    x = torch.arange(24.0).reshape(2, 3, 4)
    t = x.to("tpu")
    assert buffer_of(t).value.__class__ is Shaped and buffer_of(t).value.array.shape == (2, 3, 4)
    assert buffer_of(torch.arange(5.0).to("tpu")).value.__class__ is not Shaped  # 1-d: flat is its shape
    assert torch.equal(t.cpu(), x) and torch.equal(t[1, :, 1:3].cpu(), x[1, :, 1:3])
    t.mul_(2)  # Strict or Fused: the device reads it and writes it back
    assert torch.equal(t.cpu(), x * 2)


@pytest.mark.parametrize("mode", ["fused", "strict"], indirect=True)
def test_training_matches_cpu_and_compiles_once(mode, shaped):
    ref = _train(_recipe(40, 2), "cpu")
    model = _recipe(40, 2).to("tpu")
    assert all(_shaped_params(model))
    got = _train(model, "tpu")
    _check_equal(ref, got)
    assert [s[1] for s in got[0][1:]] == [0, 0], got[0]  # step 2 on runs step 1's programs
    if mode == "fused":  # the optimizer's program left the parameters N-d for the next forward
        assert all(_shaped_params(model))


def _compiled_train(model, device: str, steps: int = 3):
    from tpudist.compile.program import STATS

    loss_of = torch.compile(lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten()), backend="tpu",
                            fullgraph=True, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, compiled, flat = [], [], []
    for _ in range(steps):
        x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        before = (STATS.programs_compiled, STATS.flat_edge_bytes)
        loss = loss_of(model, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        compiled.append(STATS.programs_compiled - before[0])
        flat.append(STATS.flat_edge_bytes - before[1])
    return losses, compiled, flat, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_compiled_training_crosses_no_edge_flat(mode, shaped):
    torch._dynamo.reset()  # noqa: SLF001 - no graph of an earlier test with the switch off
    ref_losses, _, _, ref_params = _compiled_train(_recipe(48, 2), "cpu")
    model = _recipe(48, 2).to("tpu")
    losses, compiled, flat, params = _compiled_train(model, "tpu")
    torch._dynamo.reset()  # noqa: SLF001
    for loss, ref in zip(losses, ref_losses):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (losses, ref_losses)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)
    assert compiled[1:] == [0, 0], compiled  # (step 1's may come from the disk cache of an earlier run)
    assert flat == [0, 0, 0], flat  # parameters in, gradients out, saved activations: all in their own shape
    assert all(_shaped_params(model))
