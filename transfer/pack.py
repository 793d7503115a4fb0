"""Copying one request's layer state between a `model.cache.CachePool` and a packed region (a byte tensor)."""

from __future__ import annotations

import torch

from model.cache import CachePool

from .layout import RegionLayout

_POOL_PIECES = {"swa": "swa", "carry_kv": "carry_kv", "carry_gate": "carry_gate", "idx_carry_kv": "idx_carry_kv",
                "idx_carry_gate": "idx_carry_gate"}


def piece_view(region: torch.Tensor, layout: RegionLayout, name: str) -> torch.Tensor:
    """region: uint8 [layout.nbytes] -> the named piece as a typed, shaped view (no copy)."""
    p = layout.piece(name)
    return region[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)


def _entries(pool: CachePool, name: str, layer: int, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row indices of a request's first n entries in the paged pool, and the pool viewed flat."""
    store = getattr(pool, name)[layer]
    bs = pool.block_size
    j = torch.arange(n, device=store.device)
    blocks = torch.tensor(table, dtype=torch.int64, device=store.device)
    return blocks[j // bs] * bs + j % bs if n else j, store.view(-1, store.shape[-1])


def pack_layer(pool: CachePool, layout: RegionLayout, slot: int, table: list[int], region: torch.Tensor) -> None:
    """Copy a request's state for layout.layer into region (uint8 [layout.nbytes], same device as the pool)."""
    layer, w = layout.layer, pool.cfg.sliding_window
    ends = [p.offset for p in layout.pieces[1:]] + [layout.nbytes]
    for p, end in zip(layout.pieces, ends):
        region[p.offset + p.nbytes:end].zero_()  # alignment padding: defined bytes on the wire
        dst = piece_view(region, layout, p.name)
        if p.name in _POOL_PIECES:
            src = getattr(pool, _POOL_PIECES[p.name])[layer][slot]
            dst.copy_(src[:w] if p.name == "swa" else src)
        else:
            rows, flat = _entries(pool, p.name, layer, table, p.shape[0])
            dst.copy_(flat[rows])


def unpack_layer(pool: CachePool, layout: RegionLayout, slot: int, table: list[int], region: torch.Tensor) -> None:
    """The inverse of pack_layer: write region's state into the request's slot and blocks."""
    layer, w = layout.layer, pool.cfg.sliding_window
    for p in layout.pieces:
        src = piece_view(region, layout, p.name)
        if p.name in _POOL_PIECES:
            dst = getattr(pool, _POOL_PIECES[p.name])[layer][slot]
            (dst[:w] if p.name == "swa" else dst).copy_(src)
        else:
            rows, flat = _entries(pool, p.name, layer, table, p.shape[0])
            flat[rows] = src.to(flat.device)
