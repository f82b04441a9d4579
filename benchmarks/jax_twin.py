"""The recipe's Llama-style ``Transformer`` written in plain JAX as a JAX performance engineer would: the
anchor of ``tpu_step.py``.

What an expert JAX user writes for the same model (``tpudist/training/model.py``) and the same training
step (issue #57; MaxText's choices where they apply): a pytree of parameters, one ``jax.jit`` step (loss,
``jax.value_and_grad``, AdamW written out) that donates the parameters and optimizer state. Same shapes,
dtypes and arithmetic as the recipe:

- token embedding (untied from the output head, as in the recipe), ``n_layers`` blocks, RMSNorm, the
  output head, logits cast to float32, mean cross-entropy;
- RMSNorm in float32, the result cast back to the input dtype, then times the weight;
- rotary embeddings as rotate-half on ``wq``/``wk`` whose output rows are permuted per head (even rows,
  then odd: what ``tpu_step.hf_from_recipe`` does for Hugging Face's Llama), computed in float32. The
  recipe rotates interleaved pairs ``(x[2i], x[2i+1])``; permuting q's and k's head dims alike leaves
  every ``q . k`` unchanged, and rotate-half needs no size-2 axis (the old twin stacked one, which a
  TPU pads to 128 lanes: 8 ``convert_bitcast_fusion`` ops of 1.2 ms a step on the 2026-12-07 profile);
- projections as einsums straight into the layout the attention takes (``wq: (dim, heads, head_dim)``,
  ``wo: (heads, head_dim, dim)``): ``(batch, heads, seq, head_dim)`` for the Pallas kernels,
  ``(batch, seq, heads, head_dim)`` for XLA's; no transpose written around attention;
- grouped-query attention as the recipe computes it: k and v repeated to ``n_heads`` heads
  (``jnp.repeat``, the recipe's ``repeat_interleave``: query head ``n`` reads kv head
  ``n // (n_heads / n_kv_heads)``), so the twin's kernels get the inputs the torch modes' kernels get
  (the comparison measures the framework, not a model change either side could make);
- attention by ``attention=`` (:data:`ATTENTIONS`):

  - ``"xla"``: ``jax.nn.dot_product_attention``, XLA's on a TPU (scores in float32, the whole
    ``seq x seq`` matrix, masked half included): the old twin's attention;
  - ``"splash"``: JAX's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``, causal
    mask, 512 blocks as MaxText runs it; q scaled by ``1/sqrt(head_dim)`` first, as MaxText does), in
    interpret mode off a TPU; the sequence must be a multiple of 128;
  - ``"flash"``: the project's own Pallas kernel (``tpudist.kernels.flash_attention``), which the torch
    modes run through the device's SDPA: same kernel, so twin against compiled is the framework's cost;

- SwiGLU ``w2(silu(w1 x) * w3 x)``;
- AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay, bias corrections, the moments
  kept in the parameters' dtype), elementwise in float32 and rounded once.

Weights come from a torch ``Transformer`` (:func:`params_from_torch`), so the twin and the torch
runs start from the same state: in float32 on CPU every attention's loss equals the recipe's eager loss
through three AdamW steps (``tests/benchmarks/test_tpu_step.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

ATTENTIONS = ("xla", "splash", "flash")
# MaxText's splash blocks (its configs' sa_block_* defaults, 512): a block must divide the sequence and be a
# multiple of 128 lanes (the kernel's rule, jax 0.10.2)
SPLASH_BLOCK = 512
_LANES = 128
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


def rotate_half_permutation(head_dim: int) -> np.ndarray:
    """Per head, the even rows then the odd rows: interleaved rotary pairs ``(2i, 2i+1)`` become
    ``(i, i + head_dim/2)``."""
    return np.concatenate((np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)))


def params_from_torch(model) -> dict:
    """The twin's parameters, copied from a recipe ``Transformer`` (any device, any float dtype): linear
    weights as ``(in, out)``; q, k, v ``(dim, heads, head_dim)`` (q's and k's head dims permuted for
    rotate-half), ``wo`` ``(heads, head_dim, dim)``."""
    dtype = jnp.dtype(str(model.tok_embeddings.weight.dtype).removeprefix("torch."))
    head_dim = model.args.head_dim
    perm = rotate_half_permutation(head_dim)

    def arr(value):
        return jnp.asarray(value, dtype=dtype)

    def heads_in(linear, permute=False):  # torch (heads * head_dim, dim) -> (dim, heads, head_dim)
        w = _np(linear.weight).reshape(-1, head_dim, linear.weight.shape[1])
        return arr((w[:, perm, :] if permute else w).transpose(2, 0, 1))

    layers = []
    for block in model.layers:
        att, ffn = block.attention, block.feed_forward
        layers.append({"attention_norm": arr(_np(block.attention_norm.weight)),
                       "ffn_norm": arr(_np(block.ffn_norm.weight)),
                       "wq": heads_in(att.wq, True), "wk": heads_in(att.wk, True), "wv": heads_in(att.wv),
                       "wo": arr(_np(att.wo.weight).T.reshape(-1, head_dim, att.wo.weight.shape[0])),
                       "w1": arr(_np(ffn.w1.weight).T), "w2": arr(_np(ffn.w2.weight).T),
                       "w3": arr(_np(ffn.w3.weight).T)})
    return {"tok_embeddings": arr(_np(model.tok_embeddings.weight)), "layers": layers,
            "norm": arr(_np(model.norm.weight)), "output": arr(_np(model.output.weight).T)}


def rms_norm(x, weight, eps: float):
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def rope_tables(head_dim: int, seq: int, theta: float):
    """cos and sin ``(seq, head_dim)`` in float32, each frequency twice (rotate-half's halves)."""
    freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(seq, dtype=jnp.float32), freqs)
    angles = jnp.concatenate((angles, angles), axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate-half: ``x * cos + (-x2, x1) * sin`` on the last dim, in float32; cos, sin broadcast to ``x``."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate((-xf[..., half:], xf[..., :half]), axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# -- attention: q, k, v (equal head counts) in the layout each takes -------------------------------------
@dataclass(frozen=True, slots=True)
class Attention:
    """One attention implementation: ``fn(q, k, v, causal) -> out``, all in ``layout`` (dim letters:
    b batch, h heads, s sequence, k head dim)."""

    layout: str
    fn: Callable


def _xla_attention(q, k, v, causal: bool):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


@functools.lru_cache(maxsize=None)
def _splash_kernel(heads: int, seq: int, causal: bool, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if seq % _LANES:
        raise ValueError(f"splash attention needs seq a multiple of {_LANES} (its blocks are); got seq={seq}: "
                         "pad the batch or use attention='flash'")
    block = math.gcd(seq, SPLASH_BLOCK)
    one = masks.CausalMask((seq, seq)) if causal else masks.FullMask((seq, seq))
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return kernel.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, interpret=interpret)


def _splash_attention(q, k, v, causal: bool):
    _, heads, seq, head_dim = q.shape
    kernel = _splash_kernel(heads, seq, causal, jax.default_backend() != "tpu")
    # the kernel takes one sequence's (heads, seq, head_dim) and applies no softmax scale
    return jax.vmap(kernel)((q * (1.0 / math.sqrt(head_dim))).astype(q.dtype), k, v)


def _flash_attention(q, k, v, causal: bool):
    from tpudist.kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, causal=causal)


_ATTENTION = {"xla": Attention("bshk", _xla_attention),  # jax.nn's BTNH
              "splash": Attention("bhsk", _splash_attention),
              "flash": Attention("bhsk", _flash_attention)}


def forward(params: dict, tokens, args, attention: str = "flash"):
    """Logits ``(batch, seq, vocab)`` in float32; ``args`` is the recipe's ``ModelArgs``."""
    if attention not in _ATTENTION:
        raise ValueError(f"attention={attention!r}: the twin's attentions are {', '.join(ATTENTIONS)}")
    spec = _ATTENTION[attention]
    layout = spec.layout
    seq = tokens.shape[1]
    cos, sin = rope_tables(args.head_dim, seq, args.rope_theta)
    # cos/sin (seq, head_dim) placed on the layout's s and k dims
    table_shape = tuple(seq if d == "s" else args.head_dim if d == "k" else 1 for d in layout)
    cos, sin = cos.reshape(table_shape), sin.reshape(table_shape)
    head_axis, group = layout.index("h"), args.n_heads // args.n_kv_heads
    project, merge = f"bsd,dhk->{layout}", f"{layout},hkd->bsd"
    h = params["tok_embeddings"][tokens]
    for layer in params["layers"]:
        x = rms_norm(h, layer["attention_norm"], args.norm_eps)
        q = apply_rope(jnp.einsum(project, x, layer["wq"]), cos, sin)
        k = apply_rope(jnp.einsum(project, x, layer["wk"]), cos, sin)
        v = jnp.einsum(project, x, layer["wv"])
        k, v = (jnp.repeat(t, group, axis=head_axis) for t in (k, v))  # the recipe's repeat_interleave
        h = h + jnp.einsum(merge, spec.fn(q, k, v, args.causal), layer["wo"])
        x = rms_norm(h, layer["ffn_norm"], args.norm_eps)
        h = h + (jax.nn.silu(x @ layer["w1"]) * (x @ layer["w3"])) @ layer["w2"]
    return (rms_norm(h, params["norm"], args.norm_eps) @ params["output"]).astype(jnp.float32)


def loss_fn(params: dict, tokens, targets, args, attention: str = "flash"):
    """Mean cross-entropy of the next-token logits, as ``F.cross_entropy`` computes it."""
    logits = forward(params, tokens, args, attention)
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


def make_train_step(args, hp: AdamW, attention: str = "flash"):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``, one ``jax.jit``; params
    and optimizer state are donated (updated in place in HBM, as torch's optimizer does)."""
    if attention not in _ATTENTION:
        raise ValueError(f"attention={attention!r}: the twin's attentions are {', '.join(ATTENTIONS)}")

    from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu

    def step(params, opt_state, tokens, targets):
        # the flash kernel's pallas_calls (forward, and the backward traced by value_and_grad) in interpret
        # mode off a TPU; splash sets its own
        with pallas_interpret_unless_tpu():
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, args, attention)
        params, opt_state = adamw_update(params, grads, opt_state, hp)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
