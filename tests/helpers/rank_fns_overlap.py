"""Rank-side functions of the overlap tests: in-place forms on "tpu" and gloo, and refused aliasing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_gloo: list[Any] = []


def _data(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 100 * (rank + 1)


def _in_place(kind: str, group: Any, alias: bool) -> list[float]:
    """One in-place form on ``group`` (``alias``) or the same call with the input copied first;
    returns what this rank's output holds afterwards."""
    r, n = dist.get_rank(group), group.size()

    def own(t: torch.Tensor) -> torch.Tensor:
        return t if alias else t.clone()

    root = dist.get_global_rank(group, 0)
    if kind == "all_gather_into_tensor":  # FSDP2: the input is this rank's chunk of the output
        out = torch.zeros(n * 3)
        inp = out[r * 3:(r + 1) * 3]
        inp.copy_(_data(r, 3))
        dist.all_gather_single(out, own(inp), group=group)
        return out.tolist()
    if kind == "all_gather_list":  # the input is this rank's entry of the output list
        outs = list(torch.zeros(n, 3).unbind(0))
        outs[r].copy_(_data(r, 3))
        dist.all_gather(outs, own(outs[r]), group=group)
        return torch.cat(outs).tolist()
    if kind == "reduce_scatter_tensor":  # the output is this rank's chunk of the input
        inp = _data(r, n * 3)
        dist.reduce_scatter_single(inp[r * 3:(r + 1) * 3], own(inp), group=group)
        return inp.tolist()
    if kind == "reduce_scatter_list":  # the output is this rank's entry of the input list
        inputs = list(_data(r, n * 3).view(n, 3).unbind(0))
        dist.reduce_scatter(inputs[r], [own(t) for t in inputs], group=group)
        return torch.cat(inputs).tolist()
    if kind == "all_to_all_single":  # the output is the input
        x = _data(r, n * 2)
        dist.all_to_all_single(x, own(x), group=group)
        return x.tolist()
    if kind == "all_to_all_list":  # each output is the input of the same index
        xs = list(_data(r, n * 2).view(n, 2).unbind(0))
        dist.all_to_all(xs, [own(t) for t in xs], group=group)
        return torch.cat(xs).tolist()
    if kind == "gather":  # the root's input is its own entry of the gather list
        outs = [torch.zeros(3) for _ in range(n)]
        inp = outs[r] if dist.get_rank() == root else torch.zeros(3)
        inp.copy_(_data(r, 3))
        dist.gather(own(inp), outs if dist.get_rank() == root else None, dst=root, group=group)
        return torch.cat(outs).tolist()
    if kind == "scatter":  # the root's output is its own entry of the scatter list
        chunks = list(_data(r, n * 3).view(n, 3).unbind(0))
        out = chunks[r] if dist.get_rank() == root else torch.zeros(3)
        dist.scatter(out, [own(t) for t in chunks] if dist.get_rank() == root else None, src=root,
                     group=group)
        return out.tolist()
    if kind == "interleaved_chunks":  # non-contiguous outputs that interleave but do not overlap
        out = torch.zeros(4, 2 * n)
        outs = list(out.chunk(n, dim=1))
        dist.all_gather(outs, _data(r, 8).view(4, 2), group=group)
        return out.reshape(-1).tolist()
    raise ValueError(kind)


def in_place(kind: str, small: bool = True) -> tuple[list[float], list[float]]:
    """(tpu result of the in-place form ``kind``, gloo result of the same call on separate tensors),
    with the one-exchange path for small collectives on or off.

    The reference is gloo without aliasing: the in-place forms mean "inputs are read before outputs
    are written", and gloo's own in-place all_to_all does not honour that.
    """
    from tpudist.process_group import programs

    with programs.small_collectives(small):
        return _in_place_vs_gloo(kind)


def _in_place_vs_gloo(kind: str) -> tuple[list[float], list[float]]:
    if not _gloo:
        _gloo.append(dist.new_group(backend="gloo"))
    if kind == "interleaved_chunks":  # gloo refuses non-contiguous outputs: compare with separate ones
        r, n = dist.get_rank(), dist.get_world_size()
        parts = [torch.zeros(4, 2) for _ in range(n)]
        dist.all_gather(parts, _data(r, 8).view(4, 2), group=_gloo[0])
        return _in_place(kind, dist.group.WORLD, True), torch.cat(parts, dim=1).reshape(-1).tolist()
    return _in_place(kind, dist.group.WORLD, True), _in_place(kind, _gloo[0], False)


def aliased(kind: str) -> tuple[str, list[float]]:
    """A call whose outputs share memory; returns its error and a correct all_reduce afterwards."""
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    try:
        if kind == "all_gather_same_tensor":
            x = torch.zeros(4)
            dist.all_gather([x] * n, torch.ones(4))
        elif kind == "all_gather_partial":
            base = torch.zeros(4 * n - 1)
            dist.all_gather([base[4 * i - (i > 0):4 * (i + 1) - (i > 0)] for i in range(n)], torch.ones(4))
        elif kind == "all_to_all":
            base = torch.zeros(2 * n)
            dist.all_to_all([base[i:i + 2] for i in range(n)], list(torch.ones(n, 2).unbind(0)))
        elif kind == "reduce_scatter_tensor_coalesced":  # straight to the backend, as FSDP2 does
            out = torch.zeros(3)
            world.reduce_scatter_tensor_coalesced([out, out[1:]], [torch.ones(3 * n), torch.ones(2 * n)],
                                                  dist.ReduceScatterOptions())
        elif kind == "all_gather_into_tensor_coalesced":
            out = torch.zeros(2 * n + 1)
            world.allgather_into_tensor_coalesced([out[:2 * n], out[1:]], [torch.ones(2), torch.ones(2)])
        elif kind == "expanded_output":
            dist.all_reduce(torch.zeros(1, 3).expand(2, 3))
        elif kind == "recv_into_send_buffer":
            x, peer = torch.full((2,), float(r)), (r + 1) % n
            dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, x, peer)])
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    after = torch.ones(2)
    dist.all_reduce(after)  # nothing was left pending: the group still works
    return outcome, after.tolist()
