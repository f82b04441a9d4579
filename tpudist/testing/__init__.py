"""Multi-process test harness: N real rank processes, one per emulated chip.

Example:
    >>> from tpudist.testing import RankPool
    >>> def add_one(rank):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([float(dist.get_rank())])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> with RankPool(2) as pool:
    ...     pool.run(add_one)            # one result per rank
    [1.0, 1.0]
"""

from tpudist.testing._commands import run_command, torchrun_command
from tpudist.testing._pool import RankError, RankPeak, RankPool, RankTimeout, free_port, rank_peaks, run_ranks

__all__ = ["RankError", "RankPeak", "RankPool", "RankTimeout", "free_port", "rank_peaks", "run_command",
           "run_ranks", "torchrun_command"]
