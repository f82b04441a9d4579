"""Collectives on the chips of a TPU host, one process per chip: run by scripts/tpu_host_suite.sh.

    torchrun --nproc-per-node 4 scripts/tpu_host_collectives.py

Each check compares against values computed here in plain Python; rank 0 prints one line per check.
"""

import os

import torch
import torch.distributed as dist

dist.init_process_group("tpu")
rank, world = dist.get_rank(), dist.get_world_size()
from tpudist.process_group import runtime  # noqa: E402  after init: the runtime has booted

booted = runtime.current()
chip = booted.local_device
print(f"rank {rank}: {chip.device_kind} coords={getattr(chip, 'coords', None)} slice={booted.topology} "
      f"TPU_VISIBLE_CHIPS={os.environ.get('TPU_VISIBLE_CHIPS')} platform={booted.platform}", flush=True)
assert booted.platform == "tpu", booted.platform

x = torch.arange(8, dtype=torch.float32) + rank
dist.all_reduce(x)
assert torch.equal(x, torch.arange(8, dtype=torch.float32) * world + sum(range(world))), x
gathered = [torch.empty(3) for _ in range(world)]
dist.all_gather(gathered, torch.full((3,), float(rank)))
assert all(torch.equal(g, torch.full((3,), float(r))) for r, g in enumerate(gathered)), gathered
out = torch.empty(2)
dist.reduce_scatter_tensor(out, torch.arange(2 * world, dtype=torch.float32))
assert torch.equal(out, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * world), out
b = torch.full((4,), float(rank))
dist.broadcast(b, src=world - 1)
assert torch.equal(b, torch.full((4,), float(world - 1))), b
a2a = torch.empty(world)
dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
assert torch.equal(a2a, torch.tensor([10.0 * r + rank for r in range(world)])), a2a
dist.barrier()
if rank == 0:
    print(f"ok: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, barrier on {world} chips", flush=True)
dist.destroy_process_group()
