"""``_foreach_*`` ops (functional forms) and the fused Adam/AdamW optimizer steps.

A foreach op applies its pointwise twin to each element of its tensor lists: the lowering maps the
twin's lowering over the lists (``Tensor[]`` and ``Scalar[]`` arguments element-wise, the rest as
they are). ``call`` then casts each element to the dtype torch's meta kernel gives.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpudist.ops.lowerings import elementwise, factories, linalg, reductions, shape
from tpudist.ops.lowerings._util import is_array, is_zero, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten

_UNARY = ["abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
          "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
          "sin", "sinh", "sqrt", "tan", "tanh", "trunc"]


def _twin(name):
    """The lowering of the pointwise op a foreach op maps."""
    from tpudist.ops.registry import lowering_for

    packet = getattr(aten, name)
    return lowering_for(getattr(packet, "Tensor" if "Tensor" in packet.overloads() else "default"))


def _map(fn):
    def lowering(*args, **kwargs):
        lists = [a for a in args if isinstance(a, (list, tuple))]
        n = len(lists[0])
        return [fn(*(a[i] if isinstance(a, (list, tuple)) else a for a in args), **kwargs) for i in range(n)]
    return lowering


for _name in _UNARY:
    lowers(getattr(aten, f"_foreach_{_name}").default)(_map(_twin(_name)))

for _name in ["add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max"]:
    _packet = getattr(aten, f"_foreach_{_name}")
    _fn = {"maximum": elementwise.maximum, "minimum": elementwise.minimum, "clamp_min": elementwise.clamp_min,
           "clamp_max": elementwise.clamp_max}.get(_name) or _twin(_name)
    lowers(*[getattr(_packet, o) for o in _packet.overloads() if "out" not in o])(_map(_fn))


@lowers(aten._foreach_lerp.List, aten._foreach_lerp.Scalar, aten._foreach_lerp.ScalarList)
def foreach_lerp(xs, ends, weights):
    return _map(elementwise.lerp)(xs, ends, weights)


def _addc(fn):
    def lowering(xs, t1s, t2s, value=1):
        values = list(value) if isinstance(value, (list, tuple)) else (
            [value[i] for i in range(len(xs))] if is_array(value) and value.ndim == 1 else [value] * len(xs))
        return [fn(x, a, b, value=v) for x, a, b, v in zip(xs, t1s, t2s, values)]
    return lowering


lowers(aten._foreach_addcmul.Scalar, aten._foreach_addcmul.ScalarList, aten._foreach_addcmul.Tensor)(
    _addc(elementwise.addcmul))
lowers(aten._foreach_addcdiv.Scalar, aten._foreach_addcdiv.ScalarList, aten._foreach_addcdiv.Tensor)(
    _addc(elementwise.addcdiv))


@lowers(aten._foreach_pow.List, aten._foreach_pow.Scalar, aten._foreach_pow.ScalarList)
def foreach_pow(xs, exponents):
    exps = exponents if isinstance(exponents, (list, tuple)) else [exponents] * len(xs)
    return [elementwise.pow_tensor_tensor(x, e) if is_array(e) else elementwise.pow_tensor_scalar(x, e)
            for x, e in zip(xs, exps)]


@lowers(aten._foreach_pow.ScalarAndTensor)
def foreach_pow_scalar(base, exponents):
    return [elementwise.pow_scalar(base, e) for e in exponents]


@lowers(aten._foreach_norm.Scalar)
def foreach_norm(xs, ord=2, dtype=None):
    return [reductions.linalg_vector_norm(x, ord, dtype=dtype) for x in xs]


@lowers(aten._foreach_max.default)
def foreach_max(xs):
    return [reductions.max_(x) for x in xs]


@lowers(aten._foreach_copy.default)
def foreach_copy(xs, srcs, non_blocking=False):
    return [shape.copy(x, s) for x, s in zip(xs, srcs)]


@lowers(aten._foreach_clone.default)
def foreach_clone(xs, *, memory_format=None):
    return list(xs)


@lowers(aten._foreach_zero.default)
def foreach_zero(xs):
    return [factories.zeros_like(x) for x in xs]


@lowers(aten._foreach_mm.default)
def foreach_mm(xs, ys):
    return [linalg.matmul(x, y) for x, y in zip(xs, ys)]


# -- fused optimizers ------------------------------------------------------------------------------

def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    """torch's fused Adam(W) step (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), in float32 at least.

    ``state_steps`` hold the step count already incremented by the optimizer; returns the new params,
    grads, exp_avgs, exp_avg_sqs and max_exp_avg_sqs. With ``found_inf`` nonzero nothing changes.
    """
    outs = ([], [], [], [], [])
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        pf, gf, mf, vf = upcast(p), upcast(g), upcast(m), upcast(v)
        if grad_scale is not None:
            gf = gf / grad_scale
        if maximize:
            gf = -gf
        if not is_zero(weight_decay):  # lr, betas, eps and weight_decay may be traced scalars
            if decoupled:
                pf = pf * (1 - lr * weight_decay)
            else:
                gf = gf + weight_decay * pf
        mf = mf + (gf - mf) * (1 - beta1)
        vf = vf * beta2 + (1 - beta2) * gf * gf
        step = jnp.asarray(step, jnp.float64)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** step)
        step_size = (lr / bias_correction1).astype(pf.dtype)
        if amsgrad:
            max_v = jnp.maximum(upcast(max_exp_avg_sqs[i]), vf)
            denom = jnp.sqrt(max_v) / bias_correction2_sqrt.astype(pf.dtype) + eps
        else:
            max_v = max_exp_avg_sqs[i] if max_exp_avg_sqs else None
            denom = jnp.sqrt(vf) / bias_correction2_sqrt.astype(pf.dtype) + eps
        pf = pf - step_size * mf / denom
        new = (pf, g / grad_scale if grad_scale is not None else g, mf, vf, max_v)
        old = (p, g, m, v, max_exp_avg_sqs[i] if max_exp_avg_sqs else None)
        for out, value, prev in zip(outs, new, old):
            if prev is None:
                continue
            value = value.astype(prev.dtype)
            out.append(value if found_inf is None else jnp.where(found_inf != 0, prev, value))
    return outs


@lowers(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)
def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr, beta1=beta1,
                 beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                 grad_scale=grad_scale, found_inf=found_inf, decoupled=True)


@lowers(aten._fused_adam.default, aten._fused_adam.tensor_lr)
def fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
               weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr, beta1=beta1,
                 beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                 grad_scale=grad_scale, found_inf=found_inf, decoupled=False)


def _unscaled(g, grad_scale, maximize):
    """A fused optimizer's gradient: divided by GradScaler's scale (the kernels write this back into
    ``grads``) and, for the update only, negated under ``maximize``."""
    written = g if grad_scale is None else (upcast(g) / grad_scale.reshape(())).astype(g.dtype)
    used = upcast(written)
    return written, -used if maximize else used


def _skip_if_inf(found_inf, prev, value):
    """torch's fused kernels return before touching anything when ``found_inf`` is set."""
    value = value.astype(prev.dtype)
    return value if found_inf is None else jnp.where(found_inf.reshape(()) != 0, prev, value)


@lowers(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def fused_sgd(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):
    """torch's fused SGD step (aten/src/ATen/native/cpu/FusedSGDKernel.cpp); ``momentum_buffer_list`` is
    empty when ``momentum`` is 0, and on the first step the buffer becomes the gradient."""
    lr = lr.reshape(()) if is_array(lr) else lr
    new_params, new_grads, new_bufs = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        written, gf = _unscaled(g, grad_scale, maximize)
        pf = upcast(p)
        if not is_zero(weight_decay):
            gf = gf + weight_decay * pf
        if momentum_buffer_list:
            buf = momentum_buffer_list[i]
            bf = gf if is_first_step else upcast(buf) * momentum + (1 - dampening) * gf
            gf = gf + momentum * bf if nesterov else bf
            new_bufs.append(_skip_if_inf(found_inf, buf, bf))
        new_params.append(_skip_if_inf(found_inf, p, pf - lr * gf))
        new_grads.append(_skip_if_inf(found_inf, g, written))
    return new_params, new_grads, new_bufs


def _adagrad(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
             grad_scale, found_inf):
    """torch's fused Adagrad step (aten/src/ATen/native/cpu/FusedAdagradKernel.cpp), ``state_steps``
    already incremented by the optimizer; returns the new params, grads and state sums."""
    lr = lr.reshape(()) if is_array(lr) else lr  # a float may arrive traced too (the device's program input)
    new_params, new_grads, new_sums = [], [], []
    for p, g, s, step in zip(params, grads, state_sums, state_steps):
        written, gf = _unscaled(g, grad_scale, maximize)
        pf = upcast(p)
        if not is_zero(weight_decay):
            gf = gf + weight_decay * pf
        sf = upcast(s) + gf * gf
        clr = (lr / (1 + (jnp.asarray(step, jnp.float64).reshape(()) - 1) * lr_decay)).astype(pf.dtype)
        new_params.append(_skip_if_inf(found_inf, p, pf - clr * gf / (jnp.sqrt(sf) + eps)))
        new_grads.append(_skip_if_inf(found_inf, g, written))
        new_sums.append(_skip_if_inf(found_inf, s, sf))
    return new_params, new_grads, new_sums


@lowers(aten._fused_adagrad.default)
def fused_adagrad(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                  grad_scale=None, found_inf=None):
    # this overload's schema writes state_steps too; the kernel leaves them as they are
    return (*_adagrad(params, grads, state_sums, state_steps, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                      eps=eps, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf), list(state_steps))


@lowers(aten._fused_adagrad.tensor_lr)
def fused_adagrad_tensor_lr(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                            grad_scale=None, found_inf=None):
    return _adagrad(params, grads, state_sums, state_steps, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                    eps=eps, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)


# -- mixed-precision loss scaling (torch.amp.GradScaler) --------------------------------------------

@lowers(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_check_and_unscale(grads, found_inf, inv_scale):
    """Each gradient times ``inv_scale`` (in float32 for bf16/f16, as torch's kernels); ``found_inf``
    becomes 1 if any element of any gradient is inf or NaN, else stays as it was."""
    inv = inv_scale.reshape(())
    unscaled, bad = [], jnp.zeros((), bool)
    for g in grads:
        wide = upcast(g)
        bad = bad | jnp.any(~jnp.isfinite(wide))
        unscaled.append((wide * inv).astype(g.dtype))
    return unscaled, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


@lowers(aten._amp_update_scale.default)
def amp_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """GradScaler's update: back off and reset the tracker after an inf; otherwise count a good step and
    grow the scale (if the grown scale is finite) every ``growth_interval`` of them."""
    inf = found_inf.reshape(()) != 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = scale * jnp.asarray(growth_factor, scale.dtype)
    kept = jnp.where(grow & jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(inf, scale * jnp.asarray(backoff_factor, scale.dtype), kept)
    new_tracker = jnp.where(inf | grow, jnp.zeros_like(growth_tracker), successful).astype(growth_tracker.dtype)
    return new_scale, new_tracker
