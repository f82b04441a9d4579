"""Training code nobody here wrote, the way PyTorch users write it, on the "tpu" device (Strict, Fused,
some ``torch.compile(backend="tpu")``) against the same code on CPU eager.

Covered here and nowhere else: a DCGAN (ConvTranspose2d, BatchNorm, LeakyReLU, two Adam optimizers,
``fake.detach()``, BCEWithLogits), a VAE (reparameterisation noise drawn on the CPU and moved, KL term),
a UNet (ConvTranspose skip concat, Dice + weighted CE, bilinear interpolate with both align_corners),
``nn.TransformerEncoder``/``Decoder`` trained (key-padding and causal masks, batch_first both ways,
norm_first) and evaluated on torch's native fast path, ``nn.MultiheadAttention`` (kdim/vdim, need_weights
and average_attn_weights both ways, add_bias_kv, add_zero_attn, 3-D and float masks, eval fast path),
weight_norm / spectral_norm (power-iteration buffers) / a user parametrization and the old weight_norm,
clip_grad_norm_ / clip_grad_value_ / get_total_norm (foreach both ways), parameters_to_vector, the
optimizers beyond AdamW/SGD (foreach both ways, fused, capturable), LBFGS with a closure (and strong
Wolfe), OneCycleLR / CosineAnnealingWarmRestarts / ReduceLROnPlateau / SWALR, AveragedModel (EMA with
``_foreach_lerp_``, SWA) and update_bn, torch.func (functional_call, grad, per-sample grads with vmap,
jacrev, jacfwd, hessian, vjp, jvp), GradScaler (fp16 and bf16, a step with an inf skipped), gradient
accumulation with retain_graph, a WGAN-GP penalty through ``autograd.grad(create_graph=True)``, tensor and
module backward hooks, post-accumulate-grad hooks, and ``torch.utils.checkpoint`` (reentrant or not,
checkpoint_sequential).

Each case returns what the user would look at (losses, gradients before the step, parameters, buffers,
optimizer state, eval outputs); every floating value must be within ``FP32`` of CPU's, relative to the
largest magnitude of that value. Measured (2026-12-03): <= 2.3e-6 everywhere except LBFGS with strong
Wolfe, whose history coefficients amplify rounding to 2.2e-5 (its parameters stay within 1e-6); on an
AVX512 AMD EPYC, whose CPU kernels round differently, to 2.0e-4 (``al``; 2026-12-06).

Found and fixed with these: ``nn.MultiheadAttention`` in eval under no_grad (the fast path,
``_native_multi_head_attention``) with ``need_weights=False`` returned a (0,) tensor for the weights on
the device and None on the CPU (``test_native_mha_without_weights_returns_none_like_cpu``).

What differs from CPU and is not fixed here: ``torch.autocast("tpu")`` uses CUDA's autocast op lists,
CPU autocast its own (layer_norm, softmax, log_softmax, exp, sum, pow, ... give bfloat16 on CPU and
float32 on the device; binary_cross_entropy the other way round): ``test_autocast_bf16_trains_like_cpu``
is a strict xfail. Where the two lists agree (Linear/ReLU, mse_loss) autocast training matches
(``scaler_bf16``).

Note on comparing: gradients are read before ``opt.step()``: torch's foreach SGD with nesterov and no
weight decay adds the momentum buffer into ``p.grad`` in place, and the device (like CUDA) takes the
foreach path by default where CPU takes the per-tensor one. Conv biases before a BatchNorm, and
anything whose true gradient is 0, are compared in absolute terms only through the step's largest value.
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool

FP32 = 2e-5  # relative to the largest magnitude of each compared value
LBFGS_WOLFE = 1e-3  # its history coefficients (al, ro) amplify rounding; see the module docstring


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=900, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- cases (run in the worker) ----------------------------------------------------------------------------


def _batches(n=3, din=6, dout=3):
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, din, generator=g), torch.randn(5, dout, generator=g)) for _ in range(n)]


def _mlp(dev):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dev)


def case_dcgan(dev, compiled=False):
    import torch
    from torch import nn

    torch.manual_seed(0)
    G = nn.Sequential(nn.ConvTranspose2d(8, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
                      nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(True),
                      nn.ConvTranspose2d(8, 3, 4, 2, 1, bias=False), nn.Tanh()).to(dev)
    D = nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
                      nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2, inplace=True),
                      nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Flatten()).to(dev)
    Gc, Dc = (torch.compile(G, backend="tpu"), torch.compile(D, backend="tpu")) if compiled else (G, D)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    crit = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(3)
    rec = {}
    for i in range(3):
        real = torch.randn(4, 3, 16, 16, generator=g).to(dev)
        noise = torch.randn(4, 8, 1, 1, generator=g).to(dev)
        D.zero_grad()
        err_real = crit(Dc(real).view(-1), torch.full((4,), 1.0, device=dev))
        err_real.backward()
        fake = Gc(noise)
        err_fake = crit(Dc(fake.detach()).view(-1), torch.full((4,), 0.0, device=dev))
        err_fake.backward()
        rec[f"grad_d{i}"] = [p.grad.clone() for p in D.parameters()]
        opt_d.step()
        G.zero_grad()
        err_g = crit(Dc(fake).view(-1), torch.ones(4, device=dev))
        err_g.backward()
        rec[f"grad_g{i}"] = [p.grad.clone() for p in G.parameters()]
        opt_g.step()
        rec[f"loss{i}"] = [err_real.item(), err_fake.item(), err_g.item()]
    rec["G"], rec["D"] = G.state_dict(), D.state_dict()
    rec["opt_d"] = [s["exp_avg_sq"] for s in opt_d.state.values()]
    G.eval()
    with torch.no_grad():
        rec["eval"] = G(torch.randn(2, 8, 1, 1, generator=g).to(dev))
    return rec


def _train(model, opt, loss_of, batches, rec):
    for i, batch in enumerate(batches):
        loss = loss_of(model, batch)
        opt.zero_grad()
        loss.backward()
        rec[f"loss{i}"] = loss.item()
        rec[f"grad{i}"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    rec["state"] = model.state_dict()


def case_vae(dev):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class VAE(nn.Module):
        """pytorch/examples vae/main.py."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc21, self.fc22 = nn.Linear(20, 16), nn.Linear(16, 4), nn.Linear(16, 4)
            self.fc3, self.fc4 = nn.Linear(4, 16), nn.Linear(16, 20)

        def forward(self, x, eps):
            h = F.relu(self.fc1(x))
            mu, logvar = self.fc21(h), self.fc22(h)
            z = mu + eps * torch.exp(0.5 * logvar)
            return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar

    def loss_of(model, batch):
        x, eps = (t.to(dev) for t in batch)  # noise drawn on the CPU with a seeded generator, then moved
        recon, mu, logvar = model(x, eps)
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return F.binary_cross_entropy(recon, x, reduction="sum") + kld

    torch.manual_seed(0)
    model = VAE().to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(8, 20, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    rec = {}
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss_of, batches, rec)
    return rec


def case_unet(dev):
    import torch
    import torch.nn.functional as F
    from torch import nn

    def block(cin, cout):
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)  # a bias before BatchNorm has a 0 gradient
        return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.down1, self.down2, self.pool = block(3, 8), block(8, 16), nn.MaxPool2d(2)
            self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
            self.up1, self.out, self.aux = block(16, 8), nn.Conv2d(8, 3, 1), nn.Conv2d(16, 3, 1)

        def forward(self, x):
            a = self.down1(x)
            b = self.down2(self.pool(a))
            u = self.up1(torch.cat([self.up(b), a], dim=1))
            aux = self.aux(b)
            return (self.out(u) + 0.3 * F.interpolate(aux, scale_factor=2, mode="bilinear", align_corners=True)
                    + 0.2 * F.interpolate(aux, size=x.shape[-2:], mode="bilinear", align_corners=False))

    def loss_of(model, batch):
        x, y = (t.to(dev) for t in batch)
        logits = model(x)
        ce = F.cross_entropy(logits, y, weight=torch.tensor([1.0, 2.0, 0.5], device=dev))
        p, onehot = logits.softmax(1), F.one_hot(y, 3).permute(0, 3, 1, 2).float()
        inter = (p * onehot).sum((0, 2, 3))
        dice = 1 - ((2 * inter + 1) / (p.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1)).mean()
        return ce + dice

    torch.manual_seed(0)
    model = UNet().to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 3, (2, 16, 16), generator=g))
               for _ in range(3)]
    rec = {}
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True), loss_of, batches, rec)
    model.eval()
    with torch.no_grad():
        rec["eval"] = model(torch.randn(1, 3, 16, 16, generator=g).to(dev))
    return rec


def case_transformer(dev, batch_first=True, norm_first=False, compiled=False):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # nested tensors cannot live on tpu
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first,
                                                           norm_first=norm_first, activation="gelu"), 2)
    model = nn.ModuleList([enc, dec, nn.Linear(16, 7)]).to(dev)
    B, S, T = 3, 6, 5
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm = kpm.to(dev)
    causal = nn.Transformer.generate_square_subsequent_mask(T).to(dev)

    def tb(x):
        return x if batch_first else x.transpose(0, 1)

    def loss_of(model, batch):
        src, tgt, y = (t.to(dev) for t in batch)
        enc, dec, head = model
        memory = enc(tb(src), src_key_padding_mask=kpm)
        out = dec(tb(tgt), memory, tgt_mask=causal, memory_key_padding_mask=kpm, tgt_is_causal=True)
        return F.cross_entropy(head(tb(out)).reshape(-1, 7), y.reshape(-1))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(B, S, 16, generator=g), torch.randn(B, T, 16, generator=g),
                torch.randint(0, 7, (B, T), generator=g)) for _ in range(3)]
    rec = {}
    # SGD, not Adam: the key projection's bias has a gradient of pure rounding noise, which Adam normalises
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
           torch.compile(loss_of, backend="tpu") if compiled else loss_of, batches, rec)
    model.eval()
    with torch.no_grad():  # torch's native fast path: _transformer_encoder_layer_fwd
        src = tb(torch.randn(B, S, 16, generator=g).to(dev))
        rec["eval_padded"] = enc(src, src_key_padding_mask=kpm)
        rec["eval"] = enc(src)
        square = nn.Transformer.generate_square_subsequent_mask(S).to(dev)
        rec["eval_causal"] = enc.layers[0](src, src_mask=square, is_causal=True)
    return rec


def case_mha(dev):
    import torch
    from torch import nn

    torch.manual_seed(0)
    rec = {}
    g = torch.Generator().manual_seed(1)
    for batch_first in (True, False):
        for kdim in (None, 12):
            m = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim).to(dev)
            q, kv = torch.randn(3, 5, 16, generator=g), torch.randn(3, 6, kdim or 16, generator=g)
            if not batch_first:
                q, kv = q.transpose(0, 1), kv.transpose(0, 1)
            q, kv = q.to(dev).requires_grad_(), kv.to(dev)
            kpm = torch.zeros(3, 6, dtype=torch.bool)
            kpm[2, 3:] = True
            for need_weights in (True, False):
                for average in (True, False):
                    out, w = m(q, kv, kv, key_padding_mask=kpm.to(dev), need_weights=need_weights,
                               average_attn_weights=average)
                    out.sum().backward()
                    grads = [q.grad, *(p.grad for p in m.parameters())]
                    rec[f"{batch_first}{kdim}{need_weights}{average}"] = [out, w, *grads]
                    q.grad = None
                    m.zero_grad()
            m.eval()
            with torch.no_grad():  # _native_multi_head_attention for self-attention
                for need_weights in (True, False):
                    kv_eval = q if kdim is None else kv
                    mask = kpm[:, :5].to(dev) if kdim is None else None
                    rec[f"eval{batch_first}{kdim}{need_weights}"] = m(q, kv_eval, kv_eval, key_padding_mask=mask,
                                                                      need_weights=need_weights)
                    if kdim is None:
                        am = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1).to(dev)
                        rec[f"eval_mask{batch_first}{need_weights}"] = m(q, q, q, attn_mask=am,
                                                                         need_weights=need_weights)
    m = nn.MultiheadAttention(16, 4, add_bias_kv=True, add_zero_attn=True, batch_first=True).to(dev)
    q = torch.randn(2, 5, 16, generator=g).to(dev).requires_grad_()
    out, w = m(q, q, q)
    out.sum().backward()
    rec["bias_kv"] = [out, w, q.grad, *(p.grad for p in m.parameters())]
    m = nn.MultiheadAttention(16, 4, batch_first=True, bias=False).to(dev)
    rec["mask3d"] = m(q, q, q, attn_mask=torch.randn(8, 5, 5, generator=g).to(dev), average_attn_weights=False)
    rec["float_mask"] = m(q, q, q, attn_mask=torch.randn(5, 5, generator=g).to(dev), need_weights=False)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(5).to(dev)
    rec["causal"] = m(q, q, q, attn_mask=causal, is_causal=True, need_weights=False)[0]
    float_kpm = torch.zeros(2, 5)
    float_kpm[1, 3:] = float("-inf")
    rec["float_kpm"] = m(q, q, q, key_padding_mask=float_kpm.to(dev))
    return rec


def case_parametrizations(dev):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.utils import parametrizations, parametrize

    class Symmetric(nn.Module):
        def forward(self, X):
            return X.triu() + X.triu(1).transpose(0, 1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = parametrizations.weight_norm(nn.Linear(6, 8))
            self.b = parametrizations.spectral_norm(nn.Linear(8, 8), n_power_iterations=2)
            self.c = nn.Linear(8, 8)
            parametrize.register_parametrization(self.c, "weight", Symmetric())
            self.d = parametrizations.spectral_norm(nn.Conv1d(1, 2, 3))
            self.e = torch.nn.utils.weight_norm(nn.Linear(12, 3))  # the deprecated hook-based one

        def forward(self, x):
            h = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
            return self.e(self.d(h.unsqueeze(1)).flatten(1))

    torch.manual_seed(0)
    model = Net().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = {}
    for i, (x, y) in enumerate(_batches()):
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        rec[f"loss{i}"] = loss.item()
        rec[f"grad{i}"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        rec[f"norm{i}"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        rec[f"vec{i}"] = torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters())
        opt.step()
    rec["state"] = model.state_dict()  # spectral norm's u/v power-iteration buffers included
    model.eval()
    with torch.no_grad():
        rec["eval"] = model(x.to(dev))
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vec * 0.5, model.parameters())
    rec["vector_to_parameters"] = model.state_dict()
    return rec


def case_clipping(dev):
    import torch
    import torch.nn.functional as F

    rec = {}
    (x, y), = _batches(1)
    for foreach in (True, False):
        for norm_type in (2.0, float("inf"), 1.0):
            m = _mlp(dev)
            F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            rec[f"norm{foreach}{norm_type}"] = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type=norm_type,
                                                                            foreach=foreach)
            rec[f"grad{foreach}{norm_type}"] = [p.grad for p in m.parameters()]
        m = _mlp(dev)
        F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.05, foreach=foreach)
        rec[f"value{foreach}"] = [p.grad for p in m.parameters()]
        rec[f"total{foreach}"] = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], 3.0, foreach=foreach)
    return rec


def _optimizers(foreach_only=False):
    import torch

    O = torch.optim  # noqa: E741

    def capturable(name, **kw):  # capturable needs device-resident step counters: CPU has no such path
        def make(ps):
            ps = list(ps)
            return getattr(O, name)(ps, lr=1e-2, foreach=True, capturable=ps[0].device.type == "tpu", **kw)
        return make

    made = {}
    for fe in (True,) if foreach_only else (False, True):
        made.update({
            f"adam_amsgrad_{fe}": lambda ps, fe=fe: O.Adam(ps, lr=1e-2, amsgrad=True, foreach=fe, weight_decay=0.01),
            f"radam_{fe}": lambda ps, fe=fe: O.RAdam(ps, lr=1e-2, foreach=fe, decoupled_weight_decay=True,
                                                     weight_decay=0.1),
            f"nadam_{fe}": lambda ps, fe=fe: O.NAdam(ps, lr=1e-2, foreach=fe, decoupled_weight_decay=True,
                                                     weight_decay=0.1),
            f"adamax_{fe}": lambda ps, fe=fe: O.Adamax(ps, lr=1e-2, foreach=fe, weight_decay=0.1),
            f"asgd_{fe}": lambda ps, fe=fe: O.ASGD(ps, lr=1e-2, foreach=fe, t0=1),
            f"rprop_{fe}": lambda ps, fe=fe: O.Rprop(ps, lr=1e-2, foreach=fe),
            f"rmsprop_{fe}": lambda ps, fe=fe: O.RMSprop(ps, lr=1e-2, foreach=fe, centered=True, momentum=0.9,
                                                         weight_decay=0.1),
            f"adagrad_{fe}": lambda ps, fe=fe: O.Adagrad(ps, lr=1e-2, foreach=fe, lr_decay=0.01),
            f"adadelta_{fe}": lambda ps, fe=fe: O.Adadelta(ps, lr=1.0, foreach=fe),
        })
    if not foreach_only:
        made.update({f"{name}_fused": (lambda ps, name=name: getattr(O, name)(ps, lr=1e-2, fused=True))
                     for name in ("Adam", "AdamW", "SGD", "Adagrad")})
        made["adam_tensor_lr"] = lambda ps: O.Adam(ps, lr=torch.tensor(1e-2), foreach=False)
        made["adam_capturable"] = capturable("Adam", amsgrad=True)
        made["nadam_capturable"] = capturable("NAdam")
        made["rmsprop_capturable"] = capturable("RMSprop", centered=True)
    return made


def _run_optimizer(dev, make, closure=False, scheduler=None, steps=4):
    import torch
    import torch.nn.functional as F

    m = _mlp(dev)
    opt = make(m.parameters())
    sched = scheduler(opt) if scheduler else None
    rec = {}
    for i, (x, y) in enumerate(_batches(steps)):
        x, y = x.to(dev), y.to(dev)
        if closure:
            def step_closure():
                opt.zero_grad()
                loss = F.mse_loss(m(x), y)
                loss.backward()
                return loss
            rec[f"loss{i}"] = loss = opt.step(step_closure)
        else:
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            rec[f"loss{i}"] = loss.item()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(loss.item())  # reads the loss value from the device
        elif sched is not None:
            sched.step()
        rec[f"lr{i}"] = opt.param_groups[0]["lr"]
    rec["params"] = list(m.parameters())
    rec["opt_state"] = {str(j): dict(s) for j, s in enumerate(opt.state.values())}
    return rec


def case_optimizers(dev, foreach_only=False):
    return {name: _run_optimizer(dev, make) for name, make in _optimizers(foreach_only).items()}


def case_lbfgs(dev):
    import torch

    return _run_optimizer(dev, lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=5, history_size=3),
                          closure=True, steps=2)


def case_lbfgs_wolfe(dev):
    import torch

    return _run_optimizer(dev, lambda ps: torch.optim.LBFGS(ps, lr=1, max_iter=5, line_search_fn="strong_wolfe"),
                          closure=True, steps=2)


def case_schedulers(dev):
    import torch

    O, S = torch.optim, torch.optim.lr_scheduler  # noqa: E741
    return {
        "one_cycle": _run_optimizer(dev, lambda ps: O.SGD(ps, lr=0.1, momentum=0.9),
                                    scheduler=lambda o: S.OneCycleLR(o, 0.1, total_steps=10)),
        "warm_restarts": _run_optimizer(dev, lambda ps: O.AdamW(ps, lr=0.01),
                                        scheduler=lambda o: S.CosineAnnealingWarmRestarts(o, 2)),
        "plateau": _run_optimizer(dev, lambda ps: O.SGD(ps, lr=0.1),
                                  scheduler=lambda o: S.ReduceLROnPlateau(o, patience=0, threshold=0.5), steps=5),
    }


def case_swa(dev):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn, update_bn

    rec = {}
    for kind in ("ema_multi", "ema", "swa"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(dev)
        if kind == "ema_multi":  # _foreach_lerp_ over parameters and buffers
            avg = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        elif kind == "ema":
            avg = AveragedModel(m, avg_fn=get_ema_avg_fn(0.8))
        else:
            avg = AveragedModel(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = SWALR(opt, swa_lr=0.05, anneal_epochs=2)
        for i, (x, y) in enumerate(_batches(4)):
            opt.zero_grad()
            F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            opt.step()
            avg.update_parameters(m)
            sched.step()
            rec[f"{kind}_lr{i}"] = opt.param_groups[0]["lr"]
        if kind != "ema_multi":
            update_bn([x.to(dev) for x, _ in _batches(3)], avg, device=torch.device(dev))
        rec[kind] = avg.state_dict()
        avg.eval()
        with torch.no_grad():
            rec[f"{kind}_out"] = avg(_batches(1)[0][0].to(dev))
    return rec


def case_func(dev):
    import torch
    import torch.func as tf
    import torch.nn.functional as F
    from torch import nn

    m = _mlp(dev)
    params = {k: v.detach() for k, v in m.named_parameters()}
    (x, y), = _batches(1)
    x, y = x.to(dev), y.to(dev)

    def loss(p, xb, yb):
        return F.mse_loss(tf.functional_call(m, p, (xb.unsqueeze(0),)), yb.unsqueeze(0))

    small = nn.Linear(4, 2).to(dev)
    sp = {k: v.detach() for k, v in small.named_parameters()}
    xi = x[0, :4]

    def f(xi):
        return torch.tanh(tf.functional_call(small, sp, (xi,)))

    out, vjp_fn = tf.vjp(lambda xi: torch.sin(small(xi)), xi)
    return {
        "grad": tf.grad(loss)(params, x[0], y[0]),
        "per_sample_grads": tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(params, x, y),
        "per_sample_loss": tf.vmap(loss, in_dims=(None, 0, 0))(params, x, y),
        "jacrev": tf.jacrev(f)(xi),
        "jacfwd": tf.jacfwd(f)(xi),
        "hessian_x": tf.hessian(lambda xi: f(xi).pow(2).sum())(xi),
        "hessian_params": tf.hessian(lambda p: F.mse_loss(tf.functional_call(small, p, (x[:, :4],)), y[:, :2]))(sp),
        "vjp": vjp_fn(torch.ones_like(out)),
        "jvp": tf.jvp(lambda xi: torch.sin(small(xi)), (xi,), (torch.ones_like(xi),)),
        "vmap_model": tf.vmap(m)(x),
    }


def case_grad_scaler(dev, dtype="float16"):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 10, growth_interval=2)
    rec = {}
    for i, (x, y) in enumerate(_batches(5)):
        if i == 2:  # an inf in the input: this step must be skipped and the scale halved
            x = x.clone()
            x[0, 0] = float("inf")
        with torch.autocast(dev, dtype=getattr(torch, dtype)):
            loss = F.mse_loss(m(x.to(dev)), y.to(dev))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        rec[f"norm{i}"] = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        rec[f"grad{i}"] = [p.grad.clone() for p in m.parameters()]
        scaler.step(opt)
        scaler.update()
        rec[f"scale{i}"] = scaler.get_scale()
        rec[f"loss{i}"] = loss.float().item() if i != 2 else 0.0
    rec["params"] = list(m.parameters())
    rec["momentum"] = [s["momentum_buffer"] for s in opt.state.values()]
    return rec


def case_autocast_layernorm(dev):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rec = {}
    for i, (x, y) in enumerate(_batches()):
        with torch.autocast(dev, dtype=torch.bfloat16):
            hidden = m[1](m[0](x.to(dev)))
            rec[f"layer_norm_dtype{i}"] = str(hidden.dtype)
            loss = F.mse_loss(m[3](m[2](hidden)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        rec[f"loss{i}"] = loss.item()
        rec[f"grad{i}"] = [p.grad.clone() for p in m.parameters()]
        opt.step()
    return rec


def case_autograd_tricks(dev):
    import torch
    from torch import nn

    m = _mlp(dev)
    rec = {}
    (x, y), = _batches(1)
    x, y = x.to(dev), y.to(dev)
    h = m[0](x)  # accumulation over two backward passes through one graph
    loss1 = m[2](m[1](h)).pow(2).mean()
    loss1.backward(retain_graph=True)
    (h.sum() + loss1).backward()
    rec["accumulated"] = [p.grad.clone() for p in m.parameters()]

    m.zero_grad()  # WGAN-GP
    critic = nn.Sequential(m, nn.Linear(3, 1).to(dev))
    fake = y.repeat(1, 2)
    alpha = torch.rand(5, 1, generator=torch.Generator().manual_seed(2)).to(dev)
    inter = (alpha * x + (1 - alpha) * fake).requires_grad_(True)
    d = critic(inter)
    grads, = torch.autograd.grad(d, inter, torch.ones_like(d), create_graph=True, retain_graph=True)
    penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    (d.mean() + 10 * penalty).backward()
    rec["penalty"] = penalty
    rec["penalty_grads"] = [p.grad.clone() for p in critic.parameters()]

    critic.zero_grad()
    seen = []

    def record(module, grad_input, grad_output):
        seen.append([t.clone() for t in (*grad_input, *grad_output) if t is not None])

    hooks = [m[0].weight.register_hook(lambda g: g * 2), m[2].register_full_backward_hook(record),
             m[0].register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 0.5,))]
    xx = x.clone().requires_grad_()
    m(xx).pow(2).sum().backward()
    rec["hooked_grads"] = [p.grad.clone() for p in m.parameters()]
    rec["hook_saw"], rec["input_grad"] = seen[0], xx.grad
    for hook in hooks:
        hook.remove()

    m.zero_grad()
    def triple(p):
        p.grad.mul_(3)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(triple)
    m(x).sum().backward()
    rec["post_accumulate"] = [p.grad.clone() for p in m.parameters()]
    return rec


def case_checkpoint(dev):
    import torch
    import torch.utils.checkpoint as ckpt
    from torch import nn

    rec = {}
    weights = torch.arange(6.0, device=dev)  # LayerNorm outputs have a fixed norm: weight them
    for reentrant in (True, False):
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6)) for _ in range(3)).to(dev)
        x = _batches(1)[0][0].to(dev).requires_grad_(True)
        h = x
        for b in blocks:
            h = ckpt.checkpoint(b, h, use_reentrant=reentrant)
        (h * weights).pow(2).mean().backward()
        rec[f"grads{reentrant}"] = [*(p.grad for p in blocks.parameters()), x.grad]
        blocks.zero_grad()
        h = ckpt.checkpoint_sequential(list(blocks), 2, x.detach().requires_grad_(), use_reentrant=reentrant)
        (h * weights).sum().backward()
        rec[f"sequential{reentrant}"] = [p.grad for p in blocks.parameters()]
    return rec


CASES = {
    "dcgan": case_dcgan, "vae": case_vae, "unet": case_unet, "transformer": case_transformer,
    "transformer_seq_first_norm_first": lambda dev: case_transformer(dev, batch_first=False, norm_first=True),
    "mha": case_mha, "parametrizations": case_parametrizations, "clipping": case_clipping,
    "optimizers": case_optimizers, "optimizers_foreach": lambda dev: case_optimizers(dev, foreach_only=True),
    "lbfgs": case_lbfgs, "lbfgs_wolfe": case_lbfgs_wolfe, "schedulers": case_schedulers, "swa": case_swa,
    "func": case_func, "grad_scaler_fp16": case_grad_scaler,
    "grad_scaler_bf16": lambda dev: case_grad_scaler(dev, "bfloat16"),
    "autocast_layernorm": case_autocast_layernorm, "autograd_tricks": case_autograd_tricks,
    "checkpoint": case_checkpoint,
    "dcgan_compiled": lambda dev: case_dcgan(dev, compiled=dev == "tpu"),
    # probed 2026-12-03, within FP32, not run here: 99 s of tracing and XLA compilation on the shared machine
    "transformer_compiled": lambda dev: case_transformer(dev, norm_first=True, compiled=dev == "tpu"),
}


def _flatten(value, prefix, out):
    import torch

    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().cpu()
    elif isinstance(value, (int, float, str)):
        out[prefix] = value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif value is not None:
        raise TypeError(f"{prefix}: {type(value)}")
    return out


def run_case(name: str, mode: str) -> dict:
    """The worst relative error of the run in ``mode`` (strict, fused) against CPU eager, or the error text."""
    import torch

    import tpudist.device  # noqa: F401

    torch._dynamo.reset()
    torch.manual_seed(0)
    want = _flatten(CASES[name]("cpu"), "", {})
    before = dict(torch.tpu.cache_stats()["cpu_fallback_ops"])
    try:
        with torch.tpu.eager_mode(mode):
            torch.manual_seed(0)
            got = _flatten(CASES[name]("tpu"), "", {})
    except Exception as e:  # noqa: BLE001 - reported by name to the test process
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    fallbacks = {k: v - before.get(k, 0) for k, v in torch.tpu.cache_stats()["cpu_fallback_ops"].items()
                 if v != before.get(k, 0)}
    if set(want) != set(got):
        return {"error": f"values on one side only: {sorted(set(want) ^ set(got))[:5]}"}
    worst, where, mismatched = 0.0, None, []
    for key, w in want.items():
        g = got[key]
        if isinstance(w, float):  # losses, learning rates, loss scales read with .item()
            err = abs(g - w) / max(abs(w), 1e-6)
        elif not isinstance(w, torch.Tensor) or not w.is_floating_point():
            if not (torch.equal(w, g) if isinstance(w, torch.Tensor) else w == g):
                mismatched.append(key)
            continue
        elif g.dtype != w.dtype or g.shape != w.shape:
            mismatched.append(f"{key}: {g.dtype} {tuple(g.shape)}, cpu {w.dtype} {tuple(w.shape)}")
            continue
        else:
            w, g = w.double(), g.double()
            err = 0.0 if w.numel() == 0 else ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        if not err <= worst:
            worst, where = err, key
    return {"worst": worst, "where": where, "mismatched": mismatched, "fallbacks": fallbacks}


def _check(out, tol=FP32):
    assert "error" not in out, out
    assert not out["fallbacks"], out
    assert not out["mismatched"], out
    assert out["worst"] <= tol, out  # NaN fails too


# -- tests ----------------------------------------------------------------------------------------------------

STRICT = ["dcgan", "vae", "unet", "transformer", "transformer_seq_first_norm_first", "mha", "parametrizations",
          "clipping", "optimizers", "lbfgs", "schedulers", "swa", "func", "grad_scaler_fp16", "grad_scaler_bf16",
          "autograd_tricks", "checkpoint"]
FUSED = ["vae", "transformer_seq_first_norm_first", "parametrizations", "optimizers_foreach", "swa",
         "grad_scaler_fp16", "checkpoint"]


@pytest.mark.parametrize("name", STRICT)
def test_user_training_code_matches_cpu_strict(dev, name):
    _check(dev(run_case, name, "strict"))


@pytest.mark.parametrize("name", FUSED)
def test_user_training_code_matches_cpu_fused(dev, name):
    _check(dev(run_case, name, "fused"))


def test_compiled_dcgan_matches_cpu(dev):
    _check(dev(run_case, "dcgan_compiled", "strict"))


def run_native_mha(mode: str) -> list:
    """aten._native_multi_head_attention (MultiheadAttention's eval fast path) on tpu and CPU: per call,
    (output error, weights error or None, whether each side's weights are None)."""
    import torch

    import tpudist.device  # noqa: F401

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)
    w_in, b_in, w_out, b_out = (torch.randn(24, 8, generator=g), torch.randn(24, generator=g),
                                torch.randn(8, 8, generator=g), torch.randn(8, generator=g))
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    found = []
    with torch.tpu.eager_mode(mode):
        for need_weights in (True, False):
            for average in (True, False):
                got = []
                for dev in ("cpu", "tpu"):
                    a = [t.to(dev) for t in (x, w_in, b_in, w_out, b_out, kpm)]
                    got.append(torch.ops.aten._native_multi_head_attention(a[0], a[0], a[0], 8, 2, *a[1:5], a[5],
                                                                           need_weights, average, 1))
                (out_cpu, w_cpu), (out_tpu, w_tpu) = got
                w_err = None if w_cpu is None or w_tpu is None else (w_cpu - w_tpu.cpu()).abs().max().item()
                found.append(((out_cpu - out_tpu.cpu()).abs().max().item(), w_err, w_cpu is None, w_tpu is None))
    return found


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_native_mha_without_weights_returns_none_like_cpu(dev, mode):
    """need_weights=False: CPU's kernel returns an undefined tensor (None); the device returned a (0,)
    tensor, so ``out, w = mha(x, x, x, need_weights=False)`` in eval under no_grad gave a w that is not None
    (found by case_mha's eval fast path)."""
    found = dev(run_native_mha, mode)
    for out_err, w_err, cpu_none, tpu_none in found:
        assert out_err <= 1e-5 and (w_err is None or w_err <= 1e-6), found
    assert [(c, t) for *_, c, t in found] == [(False, False)] * 2 + [(True, True)] * 2, found


def test_lbfgs_strong_wolfe_matches_cpu(dev):
    _check(dev(run_case, "lbfgs_wolfe", "strict"), LBFGS_WOLFE)


@pytest.mark.xfail(strict=True, reason=(
    "torch.autocast('tpu') casts by CUDA's autocast op lists (tpudist/device/_autocast.py), CPU autocast by its "
    "own: layer_norm gives float32 on the device and bfloat16 on CPU (so do softmax, log_softmax, exp, log, pow, "
    "sum, cumsum, rsqrt, softplus, logsumexp, cosine_similarity, acos; binary_cross_entropy the other way round). "
    "Measured: losses 1e-3 relative apart at the first step, parameters 4.7e-2 after 3 AdamW steps. The lead "
    "owns the autocast policy"))
def test_autocast_bf16_trains_like_cpu(dev):
    _check(dev(run_case, "autocast_layernorm", "strict"), 1e-2)
