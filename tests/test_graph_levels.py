"""Which verification graph a decode batch replays: tables wide enough for its longest request, rounded up to a
power-of-two context level (the graphs themselves need a GPU: tests/test_gpu.py)."""

from __future__ import annotations

import pytest

from engine.allocator import CacheAllocator
from engine.graphs import context_levels, pick_level, table_widths


def test_levels_double_up_to_the_longest_request():
    assert context_levels(4102) == (512, 1024, 2048, 4096, 4102)
    assert context_levels(4096) == (512, 1024, 2048, 4096)
    assert context_levels(300) == (300,)


@pytest.mark.parametrize("tokens", [1, 17, 511, 512, 513, 1000, 3000, 4102])
def test_a_request_gets_the_smallest_level_that_holds_its_tables(tokens):
    ratios, bs = (4, 128), 16
    levels = context_levels(4102)
    widths = {t: table_widths(t, ratios, bs) for t in levels}
    alloc = CacheAllocator(4, {r: 4200 // r // bs + 4 for r in ratios}, bs)
    rc = alloc.admit()
    alloc.reserve(rc, tokens)
    needed = {r: len(rc.tables[r]) for r in ratios}
    level = pick_level(widths, needed)
    assert all(widths[level][r] >= needed[r] for r in ratios)
    smaller = [t for t in levels if t < level]
    assert not smaller or any(widths[smaller[-1]][r] < needed[r] for r in ratios)
    assert level < 2 * max(tokens, 512)  # never more than one doubling above what the request needs


def test_tables_beyond_the_widest_graph_are_an_error():
    widths = {512: table_widths(512, (4,), 16)}
    with pytest.raises(ValueError, match="exceed the widest graph"):
        pick_level(widths, {4: 9})
