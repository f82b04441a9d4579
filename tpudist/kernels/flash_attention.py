"""Flash attention for TPU: forward, dq and dk/dv as Pallas kernels (FlashAttention-2's split).

Pure JAX (no torch); compiled by Mosaic on TPU, run in interpret mode elsewhere. Semantics of
``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)`` on
``q (batch, q_heads, seq_q, head_dim)``, ``k (batch, kv_heads, seq_k, head_dim)``,
``v (batch, kv_heads, seq_k, head_dim_v)``, with ``q_heads`` a multiple of ``kv_heads`` (query head
``h`` reads kv head ``h // (q_heads // kv_heads)``, torch's ``repeat_interleave``; k and v are never
repeated in memory: the index maps pick the kv head). ``causal`` masks as SDPA's ``is_causal``: key
``t`` is visible to query ``s`` iff ``t <= s`` (top-left aligned, also when ``seq_q != seq_k``).

How it computes (one (query block, key block) tile per grid step):

- forward: grid ``(batch, q_heads, query blocks, key blocks)``, the key axis innermost and
  sequential; an online softmax keeps the running row maximum ``m``, sum ``l`` and the unnormalised
  output in float32 VMEM scratch, and the last key block writes ``out = acc / l`` and the
  ``logsumexp = m + log(l)`` the backward needs.
- dq: the same grid; ``p = exp(s - logsumexp)``, ``ds = p * (do @ v.T - rowsum(do * out))``,
  ``dq = scale * sum over key blocks of ds @ k``.
- dk/dv: grid ``(batch, kv_heads, key blocks, group, query blocks)``: each key block accumulates
  ``dv += p.T @ do`` and ``dk += scale * ds.T @ q`` over the query heads of its group and the query
  blocks, in the transposed orientation (scores ``k @ q.T``) so the saved row statistics broadcast
  along sublanes.

Logits, softmax and accumulation are float32; matmul operands are the input dtype (bf16 inputs: one
MXU pass, ``p`` and ``ds`` rounded to bf16 before their matmuls, as every TPU flash attention does;
float32 inputs: ``Precision.HIGHEST``). Causal tiles wholly above the diagonal are skipped: no compute
(``pl.when``) and no copy in (the index maps repeat the previous block index, and Pallas fetches only
when a block index changes). Only tiles that cross the diagonal or hold padding compute a mask.
Sequence lengths that are not a multiple of the block are padded (zeros; padded keys masked), so any
length gives the exact result; head dims other than 64 or a multiple of 128 are zero-padded to one
(:func:`kernel_head_dim`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpudist.kernels.tpu_blocks import LANES, block_spec, compiler_params, round_up, when

# Finite, so a tile whose keys are all hidden gives exp(MASK - m) = 0 and never inf - inf = NaN. Every
# real query row sees key 0 (causal or not), so its running maximum is a real score after key block 0.
# A float32 scalar: a Python float becomes an f64 constant under jax_enable_x64, and Mosaic cannot
# legalize its truncation ("failed to legalize operation 'tpu.truncf' ... (f64) -> f32", v5e, 2026-12-05).
MASK_VALUE = np.float32(-0.7 * float(np.finfo(np.float32).max))
KERNEL_DTYPES = ("bfloat16", "float32")  # Mosaic has no 64-bit floats; v5e has no f16 matmul
# (block_q, block_k) when none are given: MXU-sized tiles (v5e: 4 MXUs of 128x128); see
# benchmarks/tpu_attention.py
FORWARD_BLOCKS = (512, 512)
BACKWARD_BLOCKS = (512, 512)
F32_PRECISION = jax.lax.Precision.HIGHEST  # float32 inputs: full float32 products (Mosaic's 6-pass)
_DEFAULT_VMEM = 16 * 2**20  # Mosaic's default scoped VMEM on v5e; larger tiles ask for more
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


class AttentionShapeError(ValueError):
    """q, k, v that the flash kernels cannot take (the message says which rule and how to fix it)."""


def kernel_head_dim(head_dim: int) -> int:
    """The head dim the kernels run at: 64, or a multiple of 128 (zero-padded up to it; zeros change no
    score and add output columns that are cut off). Those are the head dims compiled and checked on a
    v5e (64 and 128; wider ones tile the row statistics as for 512-key blocks, also checked there); a
    chip run of head dims 8 and 32 failed without recording why, so they are padded."""
    return 64 if head_dim <= 64 else round_up(head_dim, LANES)


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Shapes, tiles and padding of one flash-attention call (plan first, then run the kernels)."""

    batch: int
    q_heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    block_q: int
    block_k: int
    causal: bool
    scale: float
    precision: jax.lax.Precision | None

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def padded_q(self) -> int:
        return round_up(self.seq_q, self.block_q)

    @property
    def padded_k(self) -> int:
        return round_up(self.seq_k, self.block_k)

    @property
    def num_q_blocks(self) -> int:
        return self.padded_q // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.padded_k // self.block_k

    @property
    def padded_head_dim(self) -> int:
        return kernel_head_dim(self.head_dim)

    @property
    def padded_head_dim_v(self) -> int:
        return kernel_head_dim(self.head_dim_v)

    @property
    def key_padding(self) -> bool:
        return self.padded_k != self.seq_k

    def vmem_limit(self) -> int | None:
        """Scoped VMEM for the largest kernel (dk/dv): about six float32 tiles of scores plus the
        double-buffered blocks and the accumulators; None (Mosaic's default) when that fits it."""
        scores = 6 * self.block_q * self.block_k * 4
        blocks = 2 * 4 * max(self.block_q, self.block_k) * max(self.padded_head_dim, self.padded_head_dim_v) * 4
        need = scores + blocks
        return None if 2 * need <= _DEFAULT_VMEM else round_up(2 * need, 2**20)


def plan_attention(q, k, v, *, causal: bool, scale: float | None = None, block_q: int | None = None,
                   block_k: int | None = None, backward: bool = False) -> AttentionPlan:
    """The plan for q, k, v (arrays or ShapeDtypeStructs); AttentionShapeError names what does not fit.

    Blocks not given are ``FORWARD_BLOCKS`` or ``BACKWARD_BLOCKS``, cut to the sequences (rounded up to 128).
    """
    got = f"q={_describe(q)}, k={_describe(k)}, v={_describe(v)}"
    if not (len(q.shape) == len(k.shape) == len(v.shape) == 4):
        raise AttentionShapeError(f"flash attention takes 4-d (batch, heads, seq, head_dim) q, k, v; got {got}")
    batch, q_heads, seq_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[:3] != v.shape[:3] or k.shape[3] != head_dim:
        raise AttentionShapeError(f"k and v must be (batch, kv_heads, seq_k, *) with q's batch and k with q's "
                                  f"head_dim; got {got}")
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise AttentionShapeError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (grouped-query "
                                  f"attention); got {got}")
    if min(seq_q, seq_k, head_dim, v.shape[3], batch, q_heads) == 0:
        raise AttentionShapeError(f"flash attention needs non-empty batch, heads, sequences and head dims; got {got}")
    dtypes = {str(jnp.dtype(x.dtype)) for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        raise AttentionShapeError(f"flash attention takes q, k, v of one dtype in {KERNEL_DTYPES}; got {got}: "
                                  "cast them, or use the pure-JAX attention (library.attention_reference)")
    default_q, default_k = BACKWARD_BLOCKS if backward else FORWARD_BLOCKS
    block_q, block_k = block_q or default_q, block_k or default_k
    if block_q % LANES or block_k % LANES:
        raise AttentionShapeError(f"block_q={block_q} and block_k={block_k} must be multiples of {LANES} "
                                  "(the logsumexp row and the score tiles are lane-dense)")
    dtype = dtypes.pop()
    return AttentionPlan(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
        head_dim_v=v.shape[3], block_q=min(block_q, round_up(seq_q, LANES)),
        block_k=min(block_k, round_up(seq_k, LANES)), causal=bool(causal),
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        # explicit for bf16 too: a None precision takes jax.default_matmul_precision, which tpudist sets from
        # torch's float32 setting when it traces ("highest" by default), and Mosaic rejects an fp32 contract
        # precision on bf16 operands ("Bad lhs type", seen on the v5e)
        precision=F32_PRECISION if dtype == "float32" else jax.lax.Precision.DEFAULT)


def _describe(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


# -- which tiles run, and their masks (i: query block, j: key block; int32 scalars or Python ints) ------
def _visible(plan: AttentionPlan, i, j):
    """Some key of block j is visible to some query of block i."""
    if not plan.causal:
        return True
    return j * plan.block_k <= i * plan.block_q + (plan.block_q - 1)


def _needs_mask(plan: AttentionPlan, i, j):
    """Some key of block j is hidden from some query of block i (the diagonal, or padded keys)."""
    crosses = (j + 1) * plan.block_k - 1 > i * plan.block_q if plan.causal else False
    if not plan.key_padding:
        return crosses
    padded = j == plan.num_k_blocks - 1
    return padded if crosses is False else jnp.logical_or(crosses, padded)


def _last_k_block(plan: AttentionPlan, i):
    """The last key block visible to query block i (the causal index maps stop there: no copy in)."""
    return jnp.minimum(_div(i * plan.block_q + plan.block_q - 1, plan.block_k), plan.num_k_blocks - 1)


def _first_q_block(plan: AttentionPlan, j):
    """The first query block that sees key block j."""
    return jnp.minimum(_div(j * plan.block_k, plan.block_q), plan.num_q_blocks - 1)


def _div(n, d: int):
    """``n // d`` for a non-negative int32 ``n``: truncating division (jnp's floor division of signed
    ints needs ``sign``, whose Mosaic lowering asks for the TPU generation, so it cannot lower off TPU)."""
    return jax.lax.div(jnp.asarray(n, jnp.int32), jnp.int32(d))


def _keep(plan: AttentionPlan, i, j, shape, *, keys_on_rows: bool):
    """Which entries of a score tile are visible, as a bool tile of ``shape``."""
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    if keys_on_rows:
        key, query = rows + j * plan.block_k, cols + i * plan.block_q
    else:
        query, key = rows + i * plan.block_q, cols + j * plan.block_k
    keep = key <= query if plan.causal else None
    if plan.key_padding:
        real = key < plan.seq_k
        keep = real if keep is None else jnp.logical_and(keep, real)
    return keep


def _run_tile(plan: AttentionPlan, i, j, step) -> None:
    """Calls ``step(masked)`` for a visible tile: masked only where the tile needs it."""
    visible, needs_mask = _visible(plan, i, j), _needs_mask(plan, i, j)
    if needs_mask is False:
        when(visible, lambda: step(False))
        return
    unmasked = jnp.logical_not(needs_mask)
    if visible is not True:
        needs_mask, unmasked = jnp.logical_and(visible, needs_mask), jnp.logical_and(visible, unmasked)
    when(needs_mask, lambda: step(True))
    when(unmasked, lambda: step(False))


def _dot(a, b, dims, precision):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _log(x):
    """``log(x)`` to about exp's accuracy: one Newton step on ``exp(y) = x`` after the chip's log. On a v5e
    float32 log was 1.5e-4 off (relative) and exp 4e-6, Mosaic's as XLA's default (2026-12-06; Mosaic
    takes no ``accuracy=``, see ``tpudist.ops.accuracy``), and the backward's ``p = exp(s - logsumexp)``
    carried the logsumexp's error into every gradient (5e-5 to 2e-4 from SDPA's); the step leaves
    exp's error and the square of log's."""
    y = jnp.log(x)
    return y + (x * jnp.exp(-y) - 1.0)


def _lanes(x, n: int):
    """A (rows, 128) tile of per-row values (equal across lanes) as (rows, n); n is 64 or a multiple of 128."""
    return x[:, :n] if n < LANES else jnp.tile(x, (1, n // LANES))


# -- forward -----------------------------------------------------------------------------------------
def _forward_kernel(plan: AttentionPlan, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref):
    i, j = pl.program_id(2), pl.program_id(3)

    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        s = _dot(q_ref[...], k_ref[...], _NT, plan.precision) * plan.scale
        if masked:
            s = jnp.where(_keep(plan, i, j, s.shape, keys_on_rows=False), s, MASK_VALUE)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - _lanes(m_next, plan.block_k))
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = _dot(p.astype(v_ref.dtype), v_ref[...], _NN, plan.precision)
        acc_ref[...] = acc_ref[...] * _lanes(alpha, plan.padded_head_dim_v) + pv

    def finish():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] * _lanes(1.0 / l, plan.padded_head_dim_v)).astype(o_ref.dtype)
        # the (block_q, 128) tile of equal lanes, transposed: its first row is the logsumexp lane-dense,
        # 1/128 of the bytes of storing the tile (as JAX's own TPU kernels do)
        lse_ref[...] = jnp.transpose(m_ref[...] + _log(l))[:1, :]

    when(j == 0, init)
    _run_tile(plan, i, j, step)
    when(j == plan.num_k_blocks - 1, finish)


def _forward_call(plan: AttentionPlan, q, k, v):
    """(out, logsumexp) on padded q, k, v; logsumexp as (batch, heads, padded seq_q) float32."""
    bq, bk, group = plan.block_q, plan.block_k, plan.group

    def kv_index(b, h, i, j):
        return b, _div(h, group), jnp.minimum(j, _last_k_block(plan, i)) if plan.causal else j, 0

    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, plan),
        out_shape=(jax.ShapeDtypeStruct((*q.shape[:3], plan.padded_head_dim_v), q.dtype),
                   jax.ShapeDtypeStruct((plan.batch, plan.q_heads, 1, plan.padded_q), jnp.float32)),
        grid=(plan.batch, plan.q_heads, plan.num_q_blocks, plan.num_k_blocks),
        in_specs=[block_spec((None, None, bq, plan.padded_head_dim), lambda b, h, i, j: (b, h, i, 0)),
                  block_spec((None, None, bk, plan.padded_head_dim), kv_index),
                  block_spec((None, None, bk, plan.padded_head_dim_v), kv_index)],
        out_specs=(block_spec((None, None, bq, plan.padded_head_dim_v), lambda b, h, i, j: (b, h, i, 0)),
                   block_spec((None, None, 1, bq), lambda b, h, i, j: (b, h, 0, i))),
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, plan.padded_head_dim_v), jnp.float32)],
        compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary",
                                        vmem_limit_bytes=plan.vmem_limit()),
        cost_estimate=_cost(plan, q, k, v, matmuls=2),
        name="tpudist_flash_attention",
    )(q, k, v)
    return out, lse[:, :, 0, :]


# -- backward: dq ------------------------------------------------------------------------------------
def _dq_kernel(plan: AttentionPlan, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, acc_ref):
    i, j = pl.program_id(2), pl.program_id(3)

    def init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        k = k_ref[...]
        s = _dot(q_ref[...], k, _NT, plan.precision) * plan.scale
        if masked:
            s = jnp.where(_keep(plan, i, j, s.shape, keys_on_rows=False), s, MASK_VALUE)
        # the saved rows (1, block_q) as columns (block_q, 1): a lane-to-sublane relayout, once per tile
        p = jnp.exp(s - jnp.expand_dims(lse_ref[0], -1))
        dp = _dot(do_ref[...], v_ref[...], _NT, plan.precision)
        ds = p * (dp - jnp.expand_dims(di_ref[0], -1))
        acc_ref[...] += _dot(ds.astype(k.dtype), k, _NN, plan.precision)

    def finish():
        dq_ref[...] = (acc_ref[...] * plan.scale).astype(dq_ref.dtype)

    when(j == 0, init)
    _run_tile(plan, i, j, step)
    when(j == plan.num_k_blocks - 1, finish)


def _dq_call(plan: AttentionPlan, q, k, v, do, lse, di):
    bq, bk, group = plan.block_q, plan.block_k, plan.group

    def kv_index(b, h, i, j):
        return b, _div(h, group), jnp.minimum(j, _last_k_block(plan, i)) if plan.causal else j, 0

    row_spec = block_spec((None, None, 1, bq), lambda b, h, i, j: (b, h, 0, i))
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(plan.batch, plan.q_heads, plan.num_q_blocks, plan.num_k_blocks),
        in_specs=[block_spec((None, None, bq, plan.padded_head_dim), lambda b, h, i, j: (b, h, i, 0)),
                  block_spec((None, None, bk, plan.padded_head_dim), kv_index),
                  block_spec((None, None, bk, plan.padded_head_dim_v), kv_index),
                  block_spec((None, None, bq, plan.padded_head_dim_v), lambda b, h, i, j: (b, h, i, 0)),
                  row_spec, row_spec],
        out_specs=block_spec((None, None, bq, plan.padded_head_dim), lambda b, h, i, j: (b, h, i, 0)),
        scratch_shapes=[pltpu.VMEM((bq, plan.padded_head_dim), jnp.float32)],
        compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary",
                                        vmem_limit_bytes=plan.vmem_limit()),
        cost_estimate=_cost(plan, q, k, v, matmuls=3),
        name="tpudist_flash_attention_dq",
    )(q, k, v, do, lse, di)


# -- backward: dk, dv --------------------------------------------------------------------------------
def _dkv_kernel(plan: AttentionPlan, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                dk_acc, dv_acc):
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    def init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step(masked: bool):
        q, do = q_ref[...], do_ref[...]
        s_t = _dot(k_ref[...], q, _NT, plan.precision) * plan.scale  # (block_k, block_q)
        if masked:
            s_t = jnp.where(_keep(plan, i, j, s_t.shape, keys_on_rows=True), s_t, MASK_VALUE)
        p_t = jnp.exp(s_t - lse_ref[...])
        dv_acc[...] += _dot(p_t.astype(do.dtype), do, _NN, plan.precision)
        dp_t = _dot(v_ref[...], do, _NT, plan.precision)
        ds_t = p_t * (dp_t - di_ref[...])
        dk_acc[...] += _dot(ds_t.astype(q.dtype), q, _NN, plan.precision)

    def finish():
        dk_ref[...] = (dk_acc[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    when(jnp.logical_and(g == 0, i == 0), init)
    _run_tile(plan, i, j, step)
    when(jnp.logical_and(g == plan.group - 1, i == plan.num_q_blocks - 1), finish)


def _dkv_call(plan: AttentionPlan, q, k, v, do, lse, di):
    bq, bk, group = plan.block_q, plan.block_k, plan.group

    def q_block(i, j):
        return jnp.maximum(i, _first_q_block(plan, j)) if plan.causal else i

    def q_head(h, g, j):
        if not plan.causal:
            return h * group + g
        # a key block after every query (causal, seq_k > seq_q) is seen by no head: keep the last head's
        # block of the key block before, so its steps copy nothing in
        unseen = j * plan.block_k > plan.padded_q - 1
        return h * group + jnp.where(unseen, jnp.int32(group - 1), g)

    def q_index(b, h, j, g, i):
        return b, q_head(h, g, j), q_block(i, j), 0

    def row_index(b, h, j, g, i):
        return b, q_head(h, g, j), 0, q_block(i, j)

    def kv_index(b, h, j, g, i):
        return b, h, j, 0

    row_spec = block_spec((None, None, 1, bq), row_index)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, plan),
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(plan.batch, plan.kv_heads, plan.num_k_blocks, group, plan.num_q_blocks),
        in_specs=[block_spec((None, None, bq, plan.padded_head_dim), q_index),
                  block_spec((None, None, bk, plan.padded_head_dim), kv_index),
                  block_spec((None, None, bk, plan.padded_head_dim_v), kv_index),
                  block_spec((None, None, bq, plan.padded_head_dim_v), q_index),
                  row_spec, row_spec],
        out_specs=(block_spec((None, None, bk, plan.padded_head_dim), kv_index),
                   block_spec((None, None, bk, plan.padded_head_dim_v), kv_index)),
        scratch_shapes=[pltpu.VMEM((bk, plan.padded_head_dim), jnp.float32),
                        pltpu.VMEM((bk, plan.padded_head_dim_v), jnp.float32)],
        compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary",
                                        vmem_limit_bytes=plan.vmem_limit()),
        cost_estimate=_cost(plan, q, k, v, matmuls=4),
        name="tpudist_flash_attention_dkv",
    )(q, k, v, do, lse, di)


def _cost(plan: AttentionPlan, q, k, v, *, matmuls: int):
    """XLA's scheduling hint: flops of the visible tiles (about half of them when causal)."""
    tiles = plan.batch * plan.q_heads * plan.padded_q * plan.padded_k * (0.5 if plan.causal else 1.0)
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (q, k, v))
    return pl.CostEstimate(flops=int(2 * matmuls * tiles * plan.padded_head_dim), transcendentals=int(tiles),
                           bytes_accessed=int(2 * nbytes))


# -- the functions -----------------------------------------------------------------------------------
def _pad(x, length: int, axis: int):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _unpad(x, length: int, axis: int):
    return x if x.shape[axis] == length else jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _padded(plan: AttentionPlan, q, k, v):
    """q, k, v zero-padded to the kernels' sequence lengths and head dims."""
    q = _pad(_pad(q, plan.padded_q, 2), plan.padded_head_dim, 3)
    k = _pad(_pad(k, plan.padded_k, 2), plan.padded_head_dim, 3)
    return q, k, _pad(_pad(v, plan.padded_k, 2), plan.padded_head_dim_v, 3)


def _unpadded(x, seq: int, head_dim: int):
    return _unpad(_unpad(x, seq, 2), head_dim, 3)


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                            block_q: int | None = None, block_k: int | None = None):
    """``(out, logsumexp)``: out as q's dtype ``(batch, q_heads, seq_q, head_dim_v)``, logsumexp float32
    ``(batch, q_heads, seq_q)`` (what torch's flash attention returns, and the backward takes)."""
    plan = plan_attention(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    out, lse = _forward_call(plan, *_padded(plan, q, k, v))
    return _unpadded(out, plan.seq_q, plan.head_dim_v), _unpad(lse, plan.seq_q, 2)


def flash_attention_backward(q, k, v, out, logsumexp, grad_out, *, causal: bool = False,
                             scale: float | None = None, block_q: int | None = None, block_k: int | None = None):
    """``(dq, dk, dv)`` of :func:`flash_attention_forward` for ``grad_out``, from its out and logsumexp."""
    plan = plan_attention(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k, backward=True)
    di = jnp.sum(grad_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    # padded query rows: q, do, logsumexp and di of 0, so p * (dp - di) = 0 and they add nothing to dk, dv
    rows = [_pad(x.astype(jnp.float32), plan.padded_q, 2)[:, :, None, :] for x in (logsumexp, di)]
    q_p, k_p, v_p = _padded(plan, q, k, v)
    do_p = _pad(_pad(grad_out.astype(q.dtype), plan.padded_q, 2), plan.padded_head_dim_v, 3)
    dq = _dq_call(plan, q_p, k_p, v_p, do_p, *rows)
    dk, dv = _dkv_call(plan, q_p, k_p, v_p, do_p, *rows)
    return (_unpadded(dq, plan.seq_q, plan.head_dim), _unpadded(dk, plan.seq_k, plan.head_dim),
            _unpadded(dv, plan.seq_k, plan.head_dim_v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, causal, scale, block_q, block_k):
    return flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)[0]


def _flash_fwd(q, k, v, causal, scale, block_q, block_k):
    out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    return out, (q, k, v, out, lse)


def _flash_bwd(causal, scale, block_q, block_k, residuals, grad_out):
    q, k, v, out, lse = residuals
    return flash_attention_backward(q, k, v, out, lse, grad_out, causal=causal, scale=scale, block_q=block_q,
                                    block_k=block_k)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, block_q: int | None = None,
                    block_k: int | None = None):
    """SDPA of q, k, v as Pallas kernels, differentiable (``jax.grad`` runs the dq and dk/dv kernels).

    Example:
        >>> q = jnp.ones((1, 4, 256, 64), jnp.bfloat16); kv = jnp.ones((1, 2, 256, 64), jnp.bfloat16)
        >>> flash_attention(q, kv, kv, causal=True).shape   # 4 query heads on 2 kv heads
        (1, 4, 256, 64)
    """
    return _flash(q, k, v, bool(causal), None if scale is None else float(scale), block_q, block_k)


__all__ = ["BACKWARD_BLOCKS", "FORWARD_BLOCKS", "KERNEL_DTYPES", "MASK_VALUE", "AttentionPlan",
           "AttentionShapeError", "flash_attention", "flash_attention_backward", "flash_attention_forward",
           "kernel_head_dim", "plan_attention"]
