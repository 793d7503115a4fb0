"""The model runner: a target model plus its cache pool and allocator, driven one batch at a time.

`extend` runs K new tokens for each request without touching state; `commit` keeps an accepted prefix. `prefill`
and `step` are the two common compositions (all tokens accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.cache import CachePool, ratios_of
from model.target import ExtendOut, StepBatch, Transformer

from .allocator import CacheAllocator, RequestCache
from .batch import make_batch


@dataclass(frozen=True, slots=True)
class CacheSizing:
    max_requests: int = 16
    max_tokens: int = 8192  # tokens held by all requests together
    block_size: int = 64  # compressed entries per block

    def blocks(self, ratios: tuple[int, ...]) -> dict[int, int]:
        # +1 scratch block, + one partial block per request
        return {r: self.max_tokens // r // self.block_size + self.max_requests + 1 for r in ratios}


def cache_tokens_within(cfg, layers: list[int], ratios: tuple[int, ...], dtype: torch.dtype, max_requests: int,
                        budget_bytes: int, cap: int, block_size: int = CacheSizing().block_size) -> int:
    """The most tokens (a multiple of 1024, at most `cap`) whose cache pool fits in budget_bytes: the pool is laid
    out on the meta device, so the size is exactly what allocation will take, without allocating."""
    def size(tokens: int) -> int:
        sizing = CacheSizing(max_requests, tokens, block_size)
        return CachePool(cfg, layers, max_requests + 1, sizing.blocks(ratios), block_size, "meta", dtype).nbytes()

    lo, hi = 0, max(1, cap // 1024)
    while lo < hi:  # largest k with size(1024 k) <= budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid * 1024) <= budget_bytes else (lo, mid - 1)
    return min(lo * 1024, cap)


class ModelRunner:
    def __init__(self, model: Transformer, sizing: CacheSizing = CacheSizing(), extra_layers: tuple[int, ...] = ()):
        """extra_layers: sliding-window rings kept per request besides the target's (a drafter's context)."""
        self.model, self.sizing = model, sizing
        self.ratios = ratios_of(model.cfg, model.layer_range)
        blocks = sizing.blocks(self.ratios)
        self.pool = CachePool(model.cfg, list(model.layer_range) + list(extra_layers), sizing.max_requests + 1,
                              blocks, sizing.block_size, model.device, model.dtype)
        self.alloc = CacheAllocator(sizing.max_requests + 1, blocks, sizing.block_size)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_request(self) -> RequestCache:
        rc = self.alloc.admit()
        self.pool.clear_slot(rc.slot)
        return rc

    def release(self, rc: RequestCache) -> None:
        self.alloc.release(rc)

    def batch(self, rows: list[tuple[RequestCache, list[int]]], pad_to: int | None = None) -> StepBatch:
        for rc, ids in rows:
            self.alloc.reserve(rc, rc.tokens + len(ids))
        return make_batch(rows, self.ratios, self.device, pad_to, self.sizing.block_size)

    @torch.inference_mode()
    def extend(self, batch: StepBatch, capture: tuple[int, ...] = ()) -> ExtendOut:
        return self.model.extend(batch, self.pool, capture=capture)

    def commit(self, rows: list[RequestCache], batch: StepBatch, out: ExtendOut, accepted: list[int]) -> None:
        """Keep accepted[i] of row i's new tokens (padding rows keep nothing)."""
        acc = accepted + [0] * (batch.input_ids.shape[0] - len(accepted))
        self.commit_state(batch, out, torch.tensor(acc, dtype=torch.int64, device=self.device))
        for rc, n in zip(rows, accepted):
            rc.tokens += n

    @torch.inference_mode()
    def commit_state(self, batch: StepBatch, out: ExtendOut, accepted: torch.Tensor) -> None:
        """The device side of `commit`: accepted [B] on the device; the caller updates the rows' token counts (a
        speculative step learns them only at its one transfer to the host)."""
        self.pool.commit(batch, out.pending, accepted)

    def step(self, rows: list[tuple[RequestCache, list[int]]], pad_to: int | None = None) -> torch.Tensor:
        """All new tokens accepted; returns logits [B, K, vocab] fp32 for the real rows."""
        batch = self.batch(rows, pad_to)
        out = self.extend(batch)
        self.commit([rc for rc, _ in rows], batch, out, [len(ids) for _, ids in rows])
        with torch.inference_mode():
            return self.model.logits(out.streams[: len(rows)])

    def prefill(self, rc: RequestCache, ids: list[int], chunk: int = 512) -> torch.Tensor:
        """Feed a prompt in chunks; returns logits [len(ids), vocab] fp32."""
        parts = [self.step([(rc, ids[i:i + chunk])])[0] for i in range(0, len(ids), chunk)]
        return torch.cat(parts)
