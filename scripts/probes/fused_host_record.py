"""Chip probe: the host's time to record a Fused training step, per phase, on a tiny model.

    python3 scripts/probes/fused_host_record.py [--layers 8]     # needs torch (scripts/chip_env.sh)

The recipe's Transformer at dim 64 records the same ops per step as at dim 1024, and its programs run
in well under a millisecond, so the forward's time here is the host's recording (the Fused step's
device idle before its first program, benchmarks/tpu_step.py). Prints the median per phase over 10
steps, the ops recorded per forward, and the functions the host spends the forward in (cProfile).
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401
from tpudist.training.model import ModelArgs, Transformer

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=8)
p.add_argument("--profile-top", type=int, default=25)
a = p.parse_args()
args = ModelArgs(vocab_size=512, dim=64, n_layers=a.layers, n_heads=4, n_kv_heads=2, max_seq_len=64)
torch.manual_seed(0)
model = Transformer(args).to(torch.bfloat16).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = (torch.randint(0, 512, (2, 64)).to("tpu") for _ in range(2))


def forward():
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


torch.tpu.set_eager_mode("fused")
phases = {"forward": [], "backward": [], "optimizer": [], "item+sync": []}
for step in range(14):
    t = [time.perf_counter()]
    ops_before = torch.tpu.cache_stats().get("hits", 0)
    loss = forward()
    t.append(time.perf_counter())
    ops = torch.tpu.cache_stats().get("hits", 0) - ops_before
    loss.backward()
    t.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    t.append(time.perf_counter())
    loss.item()
    torch.tpu.synchronize()
    t.append(time.perf_counter())
    if step >= 4:
        for (name, times), t0, t1 in zip(phases.items(), t, t[1:]):
            times.append(t1 - t0)
print(" ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms" for name, v in phases.items())
      + f"; {ops} op-kernel hits per forward")
profiler = cProfile.Profile()
profiler.enable()
for _ in range(5):
    loss = forward()
    loss.backward()  # runs the forward's graph; the backward's stays pending
profiler.disable()
torch.tpu.synchronize()
pstats.Stats(profiler).sort_stats("tottime").print_stats(a.profile_top)
