"""Dense layouts of torch tensors as orders of their dims: what the device keeps in a storage and the
compile backend gives its results. Pure Python: read by layers that must not import the device."""

from __future__ import annotations


def contiguous_strides(sizes) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(sizes)):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def is_contiguous(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(tuple(sizes)), reversed(tuple(strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def permuted_order(sizes, strides) -> tuple[int, ...] | None:
    """The dim order, outermost first, of a dense layout: the dims sorted so that ``strides`` are the
    contiguous strides of the sizes in that order (size-1 dims, whose strides are never used, sit where
    their stride puts them). None where the layout has gaps or overlaps (no permutation makes it dense).

    channels_last ``(N, C, H, W)`` with strides ``(HWC, 1, WC, C)`` is ``(0, 2, 3, 1)``: its storage
    holds the ``(N, H, W, C)`` array in row-major order.
    """
    sizes, strides = tuple(sizes), tuple(strides)
    order = tuple(sorted(range(len(sizes)), key=lambda d: (-strides[d], d)))
    if 0 in sizes:  # no elements: any layout is dense
        return order
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def inverse(order) -> tuple[int, ...]:
    """The permutation that undoes ``order`` (``x.permute(order).permute(inverse(order))`` is ``x``)."""
    back = [0] * len(order)
    for i, d in enumerate(order):
        back[d] = i
    return tuple(back)
