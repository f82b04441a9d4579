"""The CPU runtime's malloc tuning: which glibc knobs it sets, and the opt-out."""

from __future__ import annotations

import ctypes

import pytest

from tpudist.process_group import runtime


class _Libc:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = _Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    return fake


def test_keeps_freed_blocks_and_uses_one_arena(libc, monkeypatch):
    monkeypatch.delenv("TPUDIST_MALLOC_TUNING", raising=False)
    runtime._keep_freed_memory()
    # glibc malloc.h: M_MMAP_THRESHOLD -3, M_TRIM_THRESHOLD -1, M_ARENA_MAX -8
    assert libc.calls == [(-3, 256 * 2**20), (-1, 1024 * 2**20), (-8, 1)]


def test_opt_out_leaves_malloc_alone(libc, monkeypatch):
    monkeypatch.setenv("TPUDIST_MALLOC_TUNING", "0")
    runtime._keep_freed_memory()
    assert libc.calls == []


def test_not_glibc_is_not_an_error(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.delenv("TPUDIST_MALLOC_TUNING", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", missing)
    runtime._keep_freed_memory()  # musl and others: nothing to tune, no exception
