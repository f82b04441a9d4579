"""Greedy generation on the tpu device with a static KV cache: prefill, then one token per step.

    python recipes/generate.py --new-tokens 32 --mode fused        # the project's Llama-style model
    python recipes/generate.py --hf                                # also a tiny Hugging Face Llama

The cache is allocated once at its full length; each step writes its keys and values at the step's
position (``cache[:, pos:pos+1] = k``) and attends over the whole cache with a mask
(``arange(max_len) <= pos``). ``pos`` is a Python int that changes every step: the device makes it a
runtime input after the second value (automatic dynamic ints, docs/decoding.md), so the decode step
compiles once and is reused for every later token. The recipe prints tokens/s, the programs and kernels
compiled, and checks that the greedy tokens equal CPU eager.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from tpudist.training.model import ModelArgs, Transformer, apply_rope


class StaticKVCache:
    """Keys and values of every layer, ``(batch, max_len, n_kv_heads, head_dim)``, allocated once."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device, dtype=torch.float32):
        if max_len > args.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={args.max_seq_len} "
                             "(its rotary tables end there); raise ModelArgs.max_seq_len")
        shape = (batch, max_len, args.n_kv_heads, args.head_dim)
        self.max_len = max_len
        self.layers = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                       for _ in range(args.n_layers)]


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: StaticKVCache, pos: int) -> torch.Tensor:
    """Logits of ``tokens`` (batch, T) at positions ``pos .. pos+T-1``; writes their keys/values to ``cache``.

    The same computation as ``Transformer.forward`` (causal attention), over the cached positions.
    """
    batch, num_new = tokens.shape
    head_dim = model.args.head_dim
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[pos:pos + num_new], model.rope_sin[pos:pos + num_new]
    positions = torch.arange(num_new, device=tokens.device) + pos
    mask = torch.arange(cache.max_len, device=tokens.device)[None, :] <= positions[:, None]  # (T, max_len)
    for block, (k_cache, v_cache) in zip(model.layers, cache.layers):
        attn = block.attention
        h = block.attention_norm(x)
        q = apply_rope(attn.wq(h).view(batch, num_new, -1, head_dim), cos, sin)
        k_cache[:, pos:pos + num_new] = apply_rope(attn.wk(h).view(batch, num_new, -1, head_dim), cos, sin)
        v_cache[:, pos:pos + num_new] = attn.wv(h).view(batch, num_new, -1, head_dim)
        k = k_cache.repeat_interleave(attn.num_kv_groups, dim=2)
        v = v_cache.repeat_interleave(attn.num_kv_groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + attn.wo(out.transpose(1, 2).reshape(batch, num_new, -1))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: torch.Tensor        # (batch, new_tokens) on the CPU
    seconds: float              # prefill + decode, wall time
    step_seconds: list          # per decode step
    compiled_per_step: list     # programs + kernels compiled during each step (prefill first)


def _compiled() -> int:
    if not hasattr(torch, "tpu"):
        return 0
    stats = torch.tpu.cache_stats()
    return stats["programs"] + stats["kernels"]


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, new_tokens: int, max_len: int | None = None) -> Generation:
    """Greedy decoding of ``new_tokens`` after ``prompt`` (batch, P) on the model's device.

    Each step brings its token to the host (as a streaming generator does), which is the sync point
    that runs the step in Fused mode.
    """
    device = next(model.parameters()).device
    batch, prompt_len = prompt.shape
    cache = StaticKVCache(model.args, batch, max_len or prompt_len + new_tokens, device)
    start = time.perf_counter()
    before = _compiled()
    logits = forward_cached(model, prompt.to(device), cache, 0)
    token = logits[:, -1].argmax(-1, keepdim=True)
    out, compiled, step_seconds = [token.cpu()], [_compiled() - before], []
    for i in range(new_tokens - 1):
        t0, before = time.perf_counter(), _compiled()
        logits = forward_cached(model, token, cache, prompt_len + i)
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token.cpu())
        step_seconds.append(time.perf_counter() - t0)
        compiled.append(_compiled() - before)
    return Generation(torch.cat(out, 1), time.perf_counter() - start, step_seconds, compiled)


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _compiled_with_dynamo() -> int:
    """Eager programs and kernels plus the graphs ``torch.compile(backend="tpu")`` compiled (HF's
    generate compiles the decoding forward itself when the cache is static)."""
    from tpudist.compile import STATS

    return _compiled() + STATS.graphs + STATS.programs_compiled


def hf_generate(model, prompt: torch.Tensor, new_tokens: int, max_cache_len: int = 64,
                compile_forward: bool = True) -> tuple[torch.Tensor, float, int]:
    """(tokens, seconds, programs + kernels + compiled graphs) of HF greedy generate with the static cache.

    ``max_cache_len`` fixes the cache's size: generations of different lengths then share every shape.
    ``compile_forward=False`` keeps HF from compiling the decoding forward: it then runs op by op.
    """
    device = next(model.parameters()).device
    before, start = _compiled_with_dynamo(), time.perf_counter()
    out = model.generate(prompt.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, cache_implementation="static", max_cache_len=max_cache_len,
                         disable_compile=not compile_forward)
    out = out.cpu()
    return out[:, prompt.shape[1]:], time.perf_counter() - start, _compiled_with_dynamo() - before


def _report(name: str, seconds: float, new_tokens: int, compiled: int, equal: bool) -> None:
    print(f"{name:<34} {new_tokens / seconds:8.1f} tokens/s  compiled={compiled:4d}  equal_to_cpu={equal}")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--mode", default="fused", choices=("strict", "fused"))
    parser.add_argument("--hf", action="store_true", help="also a tiny Hugging Face Llama (needs transformers)")
    args = parser.parse_args(argv)

    import tpudist.device  # noqa: F401  (installs the "tpu" device)

    torch.tpu.set_eager_mode(args.mode)
    torch.manual_seed(0)
    margs = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=args.prompt_len + args.new_tokens)
    model = Transformer(margs).eval()
    prompt = torch.randint(0, margs.vocab_size, (1, args.prompt_len))
    reference = generate(model, prompt, args.new_tokens).tokens
    model.to("tpu")
    results = {}
    for call in ("first", "second"):
        run = generate(model, prompt, args.new_tokens)
        equal = torch.equal(run.tokens, reference)
        _report(f"tpudist model, {args.mode}, {call} call", run.seconds, args.new_tokens,
                sum(run.compiled_per_step), equal)
        results[f"model_{call}"] = run
        if not equal:
            raise SystemExit(f"greedy tokens differ from CPU eager: {run.tokens.tolist()} vs {reference.tolist()}")
    print(f"  compiled per step (prefill first): {results['model_first'].compiled_per_step}")
    if args.hf:
        hf = _hf_model()
        hf_prompt = torch.randint(0, 128, (1, args.prompt_len))
        hf_reference = hf_generate(hf, hf_prompt, args.new_tokens)[0]
        hf.to("tpu")
        for call in ("first", "second"):
            tokens, seconds, compiled = hf_generate(hf, hf_prompt, args.new_tokens)
            equal = torch.equal(tokens, hf_reference)
            _report(f"HF Llama static cache, {call} call", seconds, args.new_tokens, compiled, equal)
            results[f"hf_{call}"] = (tokens, compiled)
            if not equal:
                raise SystemExit(f"HF greedy tokens differ from CPU eager: {tokens.tolist()} vs "
                                 f"{hf_reference.tolist()}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
