"""Tensors that are views of each other: the in-place forms that are legal, and aliasing that is not."""

from __future__ import annotations

import itertools
import re

import pytest
import rank_fns_overlap as fns
import torch

from tpudist.process_group.checks import check_output, check_outputs, overlaps


# -- pure: the overlap test ---------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> set[int]:
    """Every byte address ``t`` covers, by brute force."""
    size = t.element_size()
    return {t.data_ptr() + size * sum(i * s for i, s in zip(index, t.stride())) + k
            for index in itertools.product(*map(range, t.shape)) for k in range(size)}


_BASE = torch.zeros(6, 8)
_VIEWS = {
    "whole": _BASE, "row0": _BASE[0], "row1": _BASE[1], "left": _BASE[:, :4], "right": _BASE[:, 4:],
    "even_rows": _BASE[::2], "odd_rows": _BASE[1::2], "transposed": _BASE.t(), "col1": _BASE[:, 1],
    "even_cols": _BASE[:, ::2], "odd_cols": _BASE[:, 1::2], "block": _BASE[2:4, 2:6],
    "flat_3_9": _BASE.view(-1)[3:9], "flat_9_20": _BASE.view(-1)[9:20], "empty": _BASE[0:0],
    "elsewhere": torch.zeros(3), "strided": _BASE.view(-1).as_strided((4,), (3,), 2),
    "bytes": _BASE.view(torch.uint8)[1, 5:9],
}


@pytest.mark.parametrize("a,b", list(itertools.combinations_with_replacement(_VIEWS, 2)))
def test_overlaps_is_exact_for_strided_views(a, b):
    expected = bool(_bytes(_VIEWS[a]) & _bytes(_VIEWS[b]))
    assert overlaps(_VIEWS[a], _VIEWS[b]) == expected


def test_outputs_that_interleave_without_overlapping_are_accepted():
    check_outputs("all_gather", "output_list", list(torch.zeros(4, 6).chunk(3, dim=1)))
    check_outputs("all_reduce_coalesced", "tensors", [_BASE[0], _BASE[0]], disjoint=False)


def test_an_output_whose_elements_share_memory_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "scatter: output has elements that share memory (shape (3, 3), strides (2, 1), byte offset "
            "4 of its storage: an expanded or as_strided view), so one memory location would receive "
            "several results (torch refuses such outputs too). Pass a tensor that owns its elements, "
            "e.g. t.clone(), and copy the result where it belongs.")):
        check_output("scatter", "output", _BASE.view(-1).as_strided((3, 3), (2, 1), 1))


def test_gather_outputs_that_overlap_are_refused():  # the root alone checks: no peer to wait on here
    with pytest.raises(ValueError, match=re.escape(
            "gather: gather_list[1] and gather_list[2] share memory (gather_list[1]: shape (8,), "
            "strides (1,), byte offset 32 of its storage; gather_list[2]: shape (6, 2), strides (8, 1), "
            "byte offset 24 of its storage).")):
        check_outputs("gather", "gather_list", [_BASE[0, :4], _BASE[1], _BASE[:, 6:]])


# -- real ranks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["all_gather_into_tensor", "all_gather_list", "reduce_scatter_tensor",
                                  "reduce_scatter_list", "all_to_all_single", "all_to_all_list",
                                  "gather", "scatter", "interleaved_chunks"])
@pytest.mark.parametrize("small", [True, False], ids=["envelope", "full"])
def test_in_place_forms_match_gloo(pool2, kind, small):
    # "full": the ops' own programs, where results are assembled in the caller's output directly
    for tpu, gloo in pool2.run(fns.in_place, kind, small):
        assert tpu == gloo


_SHARE = "{what}[{i}] and {what}[{j}] share memory ({what}[{i}]: {a}; {what}[{j}]: {b}). Each output " \
         "receives different data, so what they hold afterwards would depend on the order of the " \
         "writes. Pass tensors that do not overlap, e.g. torch.empty_like for each, or the chunks of " \
         "one tensor."
_FLAT = "shape ({n},), strides (1,), byte offset {offset} of its storage"
_REFUSED = {
    "all_gather_same_tensor": "ValueError: all_gather: " + _SHARE.format(
        what="output_list", i=0, j=1, a=_FLAT.format(n=4, offset=0), b=_FLAT.format(n=4, offset=0)),
    "all_gather_partial": "ValueError: all_gather: " + _SHARE.format(
        what="output_list", i=0, j=1, a=_FLAT.format(n=4, offset=0), b=_FLAT.format(n=4, offset=12)),
    "all_to_all": "ValueError: all_to_all: " + _SHARE.format(
        what="output_tensor_list", i=0, j=1, a=_FLAT.format(n=2, offset=0), b=_FLAT.format(n=2, offset=4)),
    "reduce_scatter_tensor_coalesced": "ValueError: reduce_scatter_tensor: " + _SHARE.format(
        what="outputs", i=0, j=1, a=_FLAT.format(n=3, offset=0), b=_FLAT.format(n=2, offset=4)),
    "all_gather_into_tensor_coalesced": "ValueError: all_gather_into_tensor: " + _SHARE.format(
        what="outputs", i=0, j=1, a=_FLAT.format(n=4, offset=0), b=_FLAT.format(n=4, offset=4)),
    "expanded_output": "ValueError: all_reduce: tensor has elements that share memory (shape (2, 3), "
                       "strides (0, 1), byte offset 0 of its storage: an expanded or as_strided view)",
    "recv_into_send_buffer": "ValueError: recv {peer}->{me} of (2,) torch.float32: its tensor shares "
                             "memory with the pending send {me}->{peer} of (2,) torch.float32. The "
                             "sends and recvs of a batch run in an order tpudist chooses",
}


@pytest.mark.parametrize("kind", list(_REFUSED))
def test_outputs_that_share_memory_are_refused_on_every_rank(pool2, kind):
    for rank, (outcome, after) in enumerate(pool2.run(fns.aliased, kind)):
        assert outcome.startswith(_REFUSED[kind].format(me=rank, peer=1 - rank)), outcome
        assert after == [2.0, 2.0]  # nothing was left half-issued
