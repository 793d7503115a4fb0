"""Building device batches (`model.target.StepBatch`) from host-side requests, with bucket padding."""

from __future__ import annotations

import torch

from model.target import StepBatch

from .allocator import RequestCache, blocks_for

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """Smallest bucket holding n rows (n itself beyond the largest bucket)."""
    return next((b for b in buckets if b >= n), n)


def make_batch(rows: list[tuple[RequestCache, list[int]]], ratios: tuple[int, ...], device: torch.device,
               pad_to: int | None = None, block_size: int | None = None) -> StepBatch:
    """rows: (request cache, its K new token ids); every row must add the same K tokens.

    Rows beyond len(rows) up to pad_to are padding: token 0, start 0, slot 0, scratch blocks, is_padding.
    With block_size, each block table is cut to the blocks the request's tokens after this step can fill (a
    request may hold more, reserved for its whole completion): attention reads, and a CUDA graph is chosen by, the
    tables' width."""
    k = len(rows[0][1])
    if any(len(t) != k for _, t in rows):
        raise ValueError("every row of a step batch adds the same number of tokens")
    b = max(pad_to or 0, len(rows))
    pad = b - len(rows)
    ids = [t for _, t in rows] + [[0] * k] * pad
    start = [rc.tokens for rc, _ in rows] + [0] * pad
    slots = [rc.slot for rc, _ in rows] + [0] * pad
    tables = {}
    for r in ratios:
        used = [rc.tables[r] if block_size is None else rc.tables[r][:blocks_for(rc.tokens + k, r, block_size)]
                for rc, _ in rows]
        width = max([len(t) for t in used] + [1])
        tables[r] = torch.tensor([t + [0] * (width - len(t)) for t in used] + [[0] * width] * pad,
                                 dtype=torch.int64, device=device)
    as_t = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    return StepBatch(input_ids=as_t(ids), start=as_t(start), is_padding=as_t([False] * len(rows) + [True] * pad,
                     torch.bool), slots=as_t(slots), tables=tables)
