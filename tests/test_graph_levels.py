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


def test_tables_beyond_the_widest_graph_pick_no_graph():
    widths = {512: table_widths(512, (4,), 16)}
    assert pick_level(widths, {4: 8}) == 512 and pick_level(widths, {4: 9}) is None


def test_batch_tables_cover_the_tokens_after_the_step_not_the_reservation():
    """A request reserves blocks for its whole completion at admission; a step's tables (what attention gathers
    and what picks the graph) stop at the blocks its tokens after the step can fill."""
    import torch

    from engine.batch import make_batch

    bs, ratios = 16, (4, 128)
    alloc = CacheAllocator(4, {4: 400, 128: 20}, bs)
    short, long_ = alloc.admit(), alloc.admit()
    for rc, held in ((short, 100), (long_, 1000)):
        alloc.reserve(rc, 10000)  # prompt + max_tokens
        rc.tokens = held
    batch = make_batch([(short, [1] * 6), (long_, [1] * 6)], ratios, torch.device("cpu"), block_size=bs)
    assert batch.tables[4].shape[1] == -(-(1006 // 4) // bs) == 16
    assert batch.tables[4][0, :2].tolist() == short.tables[4][:2] and batch.tables[4][0, 2:].eq(0).all()
    assert batch.tables[128].shape[1] == 1
    full = make_batch([(short, [1] * 6)], ratios, torch.device("cpu"))
    assert full.tables[4].shape[1] == len(short.tables[4])  # without block_size: everything held
