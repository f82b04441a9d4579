"""Greedy decoding on the "tpu" device (Strict, Fused) against CPU eager: per-token time, compiles per token.

    python benchmarks/decode.py                          # 16 and 64 new tokens, the project's model
    python benchmarks/decode.py --new-tokens 16 64 256 --hf

The project's Llama-style model decodes with a static KV cache (``recipes/generate.py``): a prefill,
then one step per token whose position is a Python int. For each number of new tokens and each mode:
the first call (compiles) and the median of ``--rounds`` later calls, run in a rotating order so machine
noise hits every mode alike. Printed per mode: median per-token decode time, its ratio to CPU eager,
and the programs + kernels compiled per token (prefill excluded) in the first and the later calls.
``--hf`` adds a tiny Hugging Face Llama's ``generate(cache_implementation="static")`` (whole-call time
per token, compiles including HF's own torch.compile of the decoding forward) and its ``generate`` with
the default dynamic cache (``torch.cat`` per token: grown caches on the device). ``--first-calls`` prints
issue #56's table: HF static-cache generate in Fused mode (batch 1 and a left-padded batch 2, op by op
and with HF's own compiled forward), what its first, second and third calls compile (XLA programs:
fused programs and readers; kernels: per-op kernels traced) and the third call's time per token against
CPU eager in the same run, with the targets (<= 16 XLA programs on the first call, 0 on the third,
<= 1.5x CPU eager) met or not. Writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import runpy
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # CPU eager shares the cores with XLA: one thread each

import torch  # noqa: E402

GENERATE = Path(__file__).resolve().parents[1] / "recipes" / "generate.py"
MODES = ("cpu", "strict", "fused")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="warm calls per mode (interleaved)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hf", action="store_true", help="also a tiny Hugging Face Llama (needs transformers)")
    p.add_argument("--first-calls", action="store_true",
                   help="only issue #56's table: HF static-cache generate's first/second/third call (Fused)")
    return p.parse_args(argv)


def _call(gen, model, prompt, new_tokens, mode):
    if mode == "cpu":
        run = gen["generate"](model, prompt, new_tokens)
    else:
        with torch.tpu.eager_mode(mode):
            run = gen["generate"](model, prompt, new_tokens)
    per_token = statistics.median(run.step_seconds) if run.step_seconds else float("nan")
    return run.tokens, per_token, sum(run.compiled_per_step[1:]) / max(new_tokens - 1, 1)


def _project(gen, a, new_tokens: int) -> None:
    torch.manual_seed(0)
    args = gen["ModelArgs"](vocab_size=128, dim=a.dim, n_layers=a.layers, n_heads=4, n_kv_heads=2,
                            max_seq_len=a.prompt_len + new_tokens)
    base = gen["Transformer"](args).eval()
    models = {"cpu": base, **{m: copy.deepcopy(base).to("tpu") for m in MODES[1:]}}
    prompt = torch.randint(0, args.vocab_size, (1, a.prompt_len))
    first, warm, warm_compiles, tokens = {}, {m: [] for m in MODES}, {m: 0.0 for m in MODES}, {}
    for mode in MODES:
        tokens[mode], first[mode], compiles = _call(gen, models[mode], prompt, new_tokens, mode)
        first[mode] = (first[mode], compiles)
    for r in range(a.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            out, per_token, compiles = _call(gen, models[mode], prompt, new_tokens, mode)
            warm[mode].append(per_token)
            warm_compiles[mode] = max(warm_compiles[mode], compiles)
            tokens[mode] = out if torch.equal(out, tokens[mode]) else None
    cpu = statistics.median(warm["cpu"])
    print(f"\nproject model dim={a.dim} layers={a.layers}, prompt {a.prompt_len}, {new_tokens} new tokens, "
          f"static KV cache; per-token decode time (median step), compiles per token (prefill excluded)")
    print(f"  {'mode':<7} {'first ms/tok':>12} {'first comp/tok':>15} {'warm ms/tok':>12} {'vs cpu':>7} "
          f"{'warm comp/tok':>14} {'tokens = cpu':>13}")
    for mode in MODES:
        med = statistics.median(warm[mode])
        same = tokens[mode] is not None and torch.equal(tokens[mode], tokens["cpu"])
        print(f"  {mode:<7} {first[mode][0] * 1e3:12.2f} {first[mode][1]:15.2f} {med * 1e3:12.2f} "
              f"{med / cpu:6.2f}x {warm_compiles[mode]:14.2f} {str(same):>13}")


def _hf_dynamic(gen, model, prompt, new_tokens: int):
    """(tokens, compiled) of HF greedy generate with its default dynamic cache (``torch.cat`` per token)."""
    device = next(model.parameters()).device
    before = gen["_compiled_with_dynamo"]()
    out = model.generate(prompt.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0).cpu()
    return out[:, prompt.shape[1]:], gen["_compiled_with_dynamo"]() - before


def _hf(gen, a, new_tokens: int, cache: str) -> None:
    torch.manual_seed(0)
    base = gen["_hf_model"]()
    models = {"cpu": base, **{m: copy.deepcopy(base).to("tpu") for m in MODES[1:]}}
    prompt = torch.randint(0, 128, (1, a.prompt_len))
    cache_len = a.prompt_len + max(a.new_tokens)
    rows = {}
    for mode in MODES:
        times, compiles, outs = [], [], []
        for _ in range(1 + a.rounds):
            start = time.perf_counter()
            if cache == "dynamic":
                with torch.tpu.eager_mode(mode) if mode != "cpu" else contextlib.nullcontext():
                    out, compiled = _hf_dynamic(gen, models[mode], prompt, new_tokens)
            elif mode == "cpu":
                out, _, compiled = gen["hf_generate"](models[mode], prompt, new_tokens, cache_len,
                                                      compile_forward=False)
            else:
                with torch.tpu.eager_mode(mode):
                    out, _, compiled = gen["hf_generate"](models[mode], prompt, new_tokens, cache_len)
            times.append((time.perf_counter() - start) / new_tokens)
            compiles.append(compiled / new_tokens)
            outs.append(out)
        rows[mode] = (times[0], compiles[0], statistics.median(times[1:]), max(compiles[1:]), outs)
    cpu = rows["cpu"][2]
    print(f"\nHF Llama (tiny) generate, {cache} cache, {new_tokens} new tokens; whole call per token")
    for mode, (t0, c0, tw, cw, outs) in rows.items():
        same = all(torch.equal(o, rows["cpu"][4][0]) for o in outs)
        print(f"  {mode:<7} first {t0 * 1e3:8.2f} ms/tok ({c0:.2f} comp/tok)  warm {tw * 1e3:8.2f} ms/tok "
              f"{tw / cpu:6.2f}x cpu ({cw:.2f} comp/tok)  tokens = cpu: {same}")


def _first_calls(a, new_tokens: int = 24, batch: int = 1, compile_forward: bool = False) -> None:
    """Issue #56: HF static-cache generate in Fused mode, three calls of the same shapes: what each compiles,
    and the third call's whole-call time per token against CPU eager's (the median of ``--rounds``,
    interleaved with the device's calls)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    models = {"cpu": LlamaForCausalLM(cfg).eval()}
    models["fused"] = copy.deepcopy(models["cpu"]).to("tpu")
    prompt = torch.randint(1, 128, (batch, a.prompt_len))
    mask = torch.ones_like(prompt)
    if batch == 2:
        prompt[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  cache_implementation="static", max_cache_len=64, disable_compile=not compile_forward)

    def call(mode):
        device = "tpu" if mode == "fused" else "cpu"
        start = time.perf_counter()
        with torch.tpu.eager_mode(mode) if mode != "cpu" else contextlib.nullcontext():
            out = models[mode].generate(prompt.to(device), attention_mask=mask.to(device), **kwargs).cpu()
        return out, (time.perf_counter() - start) / new_tokens

    def counts():
        from tpudist.compile import STATS

        s = torch.tpu.cache_stats()
        return s["programs"] + s["readers"] + STATS.programs_compiled, s["kernels"]

    reference, _ = call("cpu")
    compiled, same = [], True
    for _ in range(3):
        before = counts()
        out, per_token = call("fused")
        compiled.append(tuple(n - b for n, b in zip(counts(), before)))
        same = same and torch.equal(out, reference)
    times = {"cpu": [], "fused": []}
    for r in range(a.rounds):
        for mode in ("cpu", "fused") if r % 2 == 0 else ("fused", "cpu"):
            out, per_token = call(mode)
            times[mode].append(per_token)
            same = same and torch.equal(out, reference)
    cpu, fused = statistics.median(times["cpu"]), statistics.median(times["fused"])
    ratio = fused / cpu
    print(f"\nHF Llama (hidden 64, 2 layers) static cache, {'compiled forward' if compile_forward else 'op by op'}, "
          f"batch {batch}{' (left-padded)' if batch == 2 else ''}, {new_tokens} new tokens, Fused")
    print(f"  XLA programs built, calls 1/2/3: {'/'.join(str(c[0]) for c in compiled)}  "
          f"(target: <= 16 first, 0 third: {'met' if compiled[0][0] <= 16 and compiled[2][0] == 0 else 'NOT met'})")
    print(f"  per-op kernels traced, calls 1/2/3: {'/'.join(str(c[1]) for c in compiled)}  "
          f"(with the programs: {'/'.join(str(sum(c)) for c in compiled)})")
    print(f"  warm ms per token: fused {fused * 1e3:.2f}, cpu eager {cpu * 1e3:.2f}: {ratio:.2f}x "
          f"(target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); tokens = cpu: {same}")


def main(argv=None) -> None:
    a = _args(argv)
    import tpudist.device  # noqa: F401

    if a.first_calls:
        for compile_forward in (False, True):
            for batch in (1, 2):
                _first_calls(a, batch=batch, compile_forward=compile_forward)
        return
    gen = runpy.run_path(str(GENERATE), run_name="generate_recipe")
    for new_tokens in a.new_tokens:
        _project(gen, a, new_tokens)
    if a.hf:
        for cache in ("static", "dynamic"):
            for new_tokens in a.new_tokens:
                _hf(gen, a, new_tokens, cache)


if __name__ == "__main__":
    main()
