"""Decode-side parts on their own: admission under cancellation races, and unpacking into a pool that keeps fewer
layers than arrive (decoding without speculation on a DSpark checkpoint)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_service.admission import Admission, Overloaded
from engine.runner import CacheSizing, ModelRunner
from transfer.layout import region_layout, transfer_layers
from transfer.pack import pack_layer

from .conftest import random_ids, tiny_model


def test_a_waiter_cancelled_as_it_is_admitted_leaks_nothing():
    async def main():
        adm = Admission(max_running=1, max_queued=4, cache_tokens=100)
        await adm.acquire(10)
        waiter = asyncio.ensure_future(adm.acquire(10))
        await asyncio.sleep(0)
        waiter.cancel()  # cancelled ...
        adm.release(10)  # ... and, before it runs again, a slot frees up
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (adm.running, adm.tokens, adm.waiting) == (0, 0, 0)
        await adm.acquire(10)  # the slot is really free
        with pytest.raises(Overloaded):
            adm2 = Admission(max_running=1, max_queued=0, cache_tokens=100)
            await adm2.acquire(10)
            await adm2.acquire(10)
    asyncio.run(main())


def test_unpack_skips_layers_the_pool_does_not_keep():
    from decode_service.kv_receiver import KVReceiver

    target = tiny_model()
    cfg = target.cfg
    full = ModelRunner(target, CacheSizing(max_requests=1, max_tokens=512, block_size=8),
                       extra_layers=tuple(range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.dspark_num_layers)))
    rc = full.new_request()
    ids = random_ids(40, seed=3)[0].tolist()
    full.prefill(rc, ids)

    class NoTransfer:  # the receiver's arena and layout logic without a Mooncake engine
        session = "127.0.0.1:1"

        def register(self, t):
            pass

        def write(self, peer, writes):
            pass

    rx = KVReceiver(cfg, torch.float32, NoTransfer(), 4 << 20)
    res = rx.reserve(40, 10)
    for layer in transfer_layers(cfg):
        r = cfg.ratio(layer) if layer < cfg.num_hidden_layers else 0
        pack_layer(full.pool, region_layout(cfg, layer, 40, torch.float32), rc.slot, rc.tables.get(r, []),
                   rx.region(res, layer))
    plain = ModelRunner(target, CacheSizing(max_requests=1, max_tokens=512, block_size=8))  # no drafter rings
    rc2 = plain.new_request()
    plain.alloc.reserve(rc2, 41)
    rx.unpack(res, plain.pool, rc2.slot, rc2.tables)
    rc2.tokens = 40
    nxt = random_ids(1, seed=4)[0].tolist()
    torch.testing.assert_close(plain.step([(rc2, nxt)]), full.step([(rc, nxt)]), atol=1e-5, rtol=0)


def test_cache_sized_from_a_memory_budget_fits_it_exactly():
    """--cache-tokens 0 on a GPU: the most tokens (in steps of 1024) whose pool fits the budget, measured on a pool
    laid out like the real one (meta device) - and a real pool of that size takes exactly those bytes."""
    from engine.runner import cache_tokens_within
    from model.cache import CachePool, ratios_of

    target = tiny_model()
    cfg, layers, ratios = target.cfg, list(range(target.cfg.num_hidden_layers)), None
    ratios = ratios_of(cfg, range(cfg.num_hidden_layers))

    def real_bytes(tokens):
        sizing = CacheSizing(max_requests=4, max_tokens=tokens)
        return CachePool(cfg, layers, 5, sizing.blocks(ratios), sizing.block_size, "cpu", torch.float32).nbytes()

    budget = 3 << 20
    tokens = cache_tokens_within(cfg, layers, ratios, torch.float32, 4, budget, cap=1 << 30)
    assert tokens > 0 and tokens % 1024 == 0
    assert real_bytes(tokens) <= budget < real_bytes(tokens + 1024)
    assert cache_tokens_within(cfg, layers, ratios, torch.float32, 4, budget, cap=2048) == 2048  # the cap wins


def test_cache_settings_are_checked():
    from decode_service.config import DecodeConfig

    with pytest.raises(ValueError, match="cache-memory-fraction"):
        DecodeConfig(model="m", cache_memory_fraction=0)
    with pytest.raises(ValueError, match="cache-tokens"):
        DecodeConfig(model="m", cache_tokens=1000, max_model_len=4096)
    assert DecodeConfig(model="m", max_model_len=4096).cache_tokens == 0  # sized at startup


def test_cpu_cache_default_holds_an_explicit_context():
    from decode_service.config import DecodeConfig
    from decode_service.runtime import CPU_CACHE_TOKENS, default_cache_tokens

    target = tiny_model()
    cpu = torch.device("cpu")
    assert default_cache_tokens(DecodeConfig(model="m"), target, None, 1, cpu, torch.float32) == CPU_CACHE_TOKENS
    big = DecodeConfig(model="m", max_model_len=100_000)
    assert default_cache_tokens(big, target, None, 1, cpu, torch.float32) == 100_001
