"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

The layout follows torchtitan's ``models/llama`` so that its parallelisation plans apply as they
are: ``layers[i].attention.{wq,wk,wv,wo}`` and ``layers[i].feed_forward.{w1,w2,w3}`` are the
linear layers tensor parallelism splits. Attention reshapes with ``-1`` heads, so the same code runs
on a full module and on a tensor-parallel shard holding ``n_heads / tp`` heads.

``kernels="jax"`` computes RMSNorm and attention with ``tpudist.kernels.library`` (one JAX kernel each,
on the "tpu" device and on CPU tensors alike) instead of torch ops; the results are the same.
``causal=False`` makes attention bidirectional; a right-padded batch then needs its key-padding mask
(``Transformer.forward(tokens, key_padding_mask)``), which a causal model does not: with padding on
the right, real positions never attend to a later padding position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("torch", "jax")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Shape of a decoder.

    Example:
        >>> ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2).head_dim
        16
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 0  # 0: SwiGLU's 2/3 * 4 * dim, rounded up to a multiple of 16
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    causal: bool = True
    kernels: str = "torch"  # "torch": torch ops; "jax": tpudist.kernels.library's rms_norm and attention

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r} must be one of {', '.join(KERNELS)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} "
                             "(grouped-query attention shares each kv head among n_heads/n_kv_heads heads)")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings; "
                             "change dim or n_heads")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-(2 * 4 * self.dim // 3) // 16) * 16

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.dim * self.hidden_dim
        per_layer = attn + ffn + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: str = "torch"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "jax":
            from tpudist.kernels.library import rms_norm

            return rms_norm(x, self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``(max_seq_len, head_dim // 2)``; real-valued (DTensor has no complex ops)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x: (batch, seq, heads, head_dim)``."""
    x_even, x_odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.num_kv_groups = args.n_heads // args.n_kv_heads
        self.causal, self.kernels = args.causal, args.kernels
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = apply_rope(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        k = k.repeat_interleave(self.num_kv_groups, dim=2)
        v = v.repeat_interleave(self.num_kv_groups, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # causal + right padding: real queries never see the padding keys after them, so no mask
        mask = None if self.causal or key_padding_mask is None else key_padding_mask[:, None, None, :]
        if self.kernels == "jax":
            if mask is not None:
                raise ValueError("kernels='jax' has no attention mask (tpudist.kernels.library.attention is "
                                 "causal or full): a bidirectional model with a key-padding mask needs "
                                 "kernels='torch'")
            from tpudist.kernels.library import attention

            out = attention(q, k, v, causal=self.causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, key_padding_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only language model: ``tokens (batch, seq) -> logits (batch, seq, vocab)``.

    Example:
        >>> model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        depth_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for block in self.layers:
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(linear.weight, std=depth_std)
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim ** -0.5)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens``; ``key_padding_mask`` (batch, seq), True at real tokens, is used by a
        bidirectional model only (see the module docstring)."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, cos, sin) if key_padding_mask is None else block(h, cos, sin, key_padding_mask)
        return self.output(self.norm(h)).float()
