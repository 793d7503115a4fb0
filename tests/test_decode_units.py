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
