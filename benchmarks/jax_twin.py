"""The recipe's Llama-style ``Transformer`` written by hand in plain JAX: the anchor of ``tpu_step.py``.

What a JAX user would write for the same model (``tpudist/training/model.py``) and the same training
step: a pytree of parameters, one ``jax.jit`` step (loss, ``jax.value_and_grad``, AdamW written out)
that donates the parameters and optimizer state. Same shapes, dtypes and arithmetic as the recipe:

- token embedding (untied from the output head, as in the recipe), ``n_layers`` blocks, RMSNorm, the
  output head, logits cast to float32, mean cross-entropy;
- RMSNorm in float32, the result cast back to the input dtype, then times the weight;
- rotary embeddings on interleaved pairs ``(x[2i], x[2i+1])`` computed in float32 (the recipe's
  ``apply_rope``, not Hugging Face's rotate-half);
- grouped-query attention through ``jax.nn.dot_product_attention(is_causal=True)`` (query head ``n``
  reads kv head ``n // (n_heads / n_kv_heads)``: the recipe's ``repeat_interleave``), XLA's
  implementation on TPU: scores in float32, the whole ``seq x seq`` matrix materialized;
- SwiGLU ``w2(silu(w1 x) * w3 x)``;
- AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay, bias corrections, the moments
  kept in the parameters' dtype), elementwise in float32 and rounded once.

Weights come from a torch ``Transformer`` (:func:`params_from_torch`), so the twin and the torch
runs start from the same state: in float32 on CPU the twin's loss equals the recipe's eager loss
(``tests/benchmarks/test_tpu_step.py``). Linear weights are stored ``(in, out)``: ``x @ w``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True, slots=True)
class AdamW:
    """``torch.optim.AdamW``'s hyper-parameters (its defaults, but the learning rate: the benchmarks' 1e-3)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def torch_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay}


def _np(tensor) -> np.ndarray:
    # numpy has no bfloat16: go through float32 (exact for bf16 and f16 values) and cast on the JAX side.
    # A copy: a float32 CPU tensor's numpy() shares its memory, which JAX's CPU arrays may alias, and
    # the torch model trains in place
    return tensor.detach().cpu().float().numpy().copy()


def params_from_torch(model) -> dict:
    """The twin's parameters, copied from a recipe ``Transformer`` (any device, any float dtype)."""
    dtype = jnp.dtype(str(model.tok_embeddings.weight.dtype).removeprefix("torch."))

    def arr(tensor, transpose=False):
        value = _np(tensor)
        return jnp.asarray(value.T if transpose else value, dtype=dtype)

    layers = []
    for block in model.layers:
        att, ffn = block.attention, block.feed_forward
        layers.append({"attention_norm": arr(block.attention_norm.weight), "ffn_norm": arr(block.ffn_norm.weight),
                       "wq": arr(att.wq.weight, True), "wk": arr(att.wk.weight, True),
                       "wv": arr(att.wv.weight, True), "wo": arr(att.wo.weight, True),
                       "w1": arr(ffn.w1.weight, True), "w2": arr(ffn.w2.weight, True),
                       "w3": arr(ffn.w3.weight, True)})
    return {"tok_embeddings": arr(model.tok_embeddings.weight), "layers": layers,
            "norm": arr(model.norm.weight), "output": arr(model.output.weight, True)}


def rms_norm(x, weight, eps: float):
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def rope_tables(head_dim: int, seq: int, theta: float):
    freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(seq, dtype=jnp.float32), freqs)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates the pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x: (batch, seq, heads, head_dim)``."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.stack((even * cos - odd * sin, even * sin + odd * cos), axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def forward(params: dict, tokens, args):
    """Logits ``(batch, seq, vocab)`` in float32; ``args`` is the recipe's ``ModelArgs``."""
    batch, seq = tokens.shape
    cos, sin = rope_tables(args.head_dim, seq, args.rope_theta)
    h = params["tok_embeddings"][tokens]
    for layer in params["layers"]:
        x = rms_norm(h, layer["attention_norm"], args.norm_eps)
        q = apply_rope((x @ layer["wq"]).reshape(batch, seq, args.n_heads, args.head_dim), cos, sin)
        k = apply_rope((x @ layer["wk"]).reshape(batch, seq, args.n_kv_heads, args.head_dim), cos, sin)
        v = (x @ layer["wv"]).reshape(batch, seq, args.n_kv_heads, args.head_dim)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=args.causal)
        h = h + attn.reshape(batch, seq, -1) @ layer["wo"]
        x = rms_norm(h, layer["ffn_norm"], args.norm_eps)
        h = h + (jax.nn.silu(x @ layer["w1"]) * (x @ layer["w3"])) @ layer["w2"]
    return (rms_norm(h, params["norm"], args.norm_eps) @ params["output"]).astype(jnp.float32)


def loss_fn(params: dict, tokens, targets, args):
    """Mean cross-entropy of the next-token logits, as ``F.cross_entropy`` computes it."""
    logits = forward(params, tokens, args)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def adamw_init(params: dict) -> dict:
    return {"step": jnp.zeros((), jnp.int32), "exp_avg": jax.tree.map(jnp.zeros_like, params),
            "exp_avg_sq": jax.tree.map(jnp.zeros_like, params)}


def adamw_update(params: dict, grads: dict, state: dict, hp: AdamW) -> tuple[dict, dict]:
    """One ``torch.optim.AdamW`` step: ``p *= 1 - lr*wd``; moments; ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``."""
    step = state["step"] + 1
    t = step.astype(jnp.float32)
    bias1, bias2 = 1 - hp.beta1 ** t, 1 - hp.beta2 ** t

    def one(p, g, m, v):
        pf, gf = p.astype(jnp.float32), g.astype(jnp.float32)
        m = m.astype(jnp.float32) + (gf - m.astype(jnp.float32)) * (1 - hp.beta1)  # torch: exp_avg.lerp_(g, 1-b1)
        v = v.astype(jnp.float32) * hp.beta2 + (1 - hp.beta2) * gf * gf
        pf = pf * (1 - hp.lr * hp.weight_decay)
        pf = pf - (hp.lr / bias1) * m / (jnp.sqrt(v) / jnp.sqrt(bias2) + hp.eps)
        return pf.astype(p.dtype), m.astype(p.dtype), v.astype(p.dtype)

    treedef = jax.tree.structure(params)
    flat = [one(*leaves) for leaves in zip(*(jax.tree.leaves(tree) for tree in
                                             (params, grads, state["exp_avg"], state["exp_avg_sq"])))]
    new_params, m, v = (jax.tree.unflatten(treedef, [triple[i] for triple in flat]) for i in range(3))
    return new_params, {"step": step, "exp_avg": m, "exp_avg_sq": v}


def make_train_step(args, hp: AdamW):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``, jitted; params and
    optimizer state are donated (updated in place in HBM, as torch's optimizer does)."""

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, args)
        params, opt_state = adamw_update(params, grads, opt_state, hp)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
