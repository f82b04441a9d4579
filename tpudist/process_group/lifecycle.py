"""How a "tpu" group ends: what ``abort()`` releases at once, and what XLA does not let go of.

torch calls ``shutdown()`` on every group from ``dist.destroy_process_group()`` and ``abort()`` from
``torch.distributed.distributed_c10d._abort_process_group()`` (subgroups first, the world last;
torch 2.13). The two differ in how they treat work that has not finished:

| | ``shutdown()`` (destroy) | ``abort()`` |
|---|---|---|
| queued collectives, pending send/recv | run first | fail at once with CollectiveError |
| a collective inside XLA | waited for | whoever waits on it is released at once with CollectiveError; the XLA call goes on until it completes or reaches XLA's collective timeout (XLA cannot cancel it), and so does the thread running it: the caller's own, for a synchronous collective |
| JAX runtime: coordinator port (rank 0), XLA's gloo listener, the comm thread | shut down with the world (a barrier of every rank) | as shutdown when nothing is inside XLA; else left until the next ``init_process_group("tpu")`` in this process, which tears it down first |
| the group's c10d store | released | released |

The comm stream is one FIFO for every group of the process, so ``abort()`` of any group fails the
collectives queued on all of them: none could run before the one stuck in XLA anyway.
"""

from __future__ import annotations

from typing import Any

from tpudist.process_group import runtime
from tpudist.process_group.p2p import P2P
from tpudist.process_group.work import STREAM, CollectiveError


class CollectiveAborted(CollectiveError):
    """The collective was failed by ``abort()`` before it completed."""


def abort(group: Any) -> None:
    """``ProcessGroupTPU.abort()``: end this process's part of ``group`` without waiting for peers.

    Returns at once. If no collective is inside XLA, this is ``shutdown()`` minus the waiting: the
    runtime is torn down and a new ``init_process_group("tpu")`` works (with every rank aborting, as
    torch's abort is per process but JAX's teardown is a barrier). Otherwise see the module table.
    """
    error = CollectiveAborted(
        f"{group.channel.describe('a collective')} was aborted before it completed (abort() or "
        "_abort_process_group()); destroy the group and call init_process_group again")
    P2P.cancel(error)
    if not STREAM.abort(error):
        group.shutdown()
        return
    if group.channel.is_world:
        runtime.abandon(owner=group)
    group.channel.store = None
