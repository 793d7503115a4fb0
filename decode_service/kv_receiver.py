"""The decode side of the hand-off: a receive arena registered with Mooncake once, per-request reservations of
one packed region per transferred layer, and unpacking landed regions into the engine's cache pool."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from model.cache import CachePool
from model.config import ModelConfig
from proto import prefill_pb2
from transfer.arena import Arena, Slice
from transfer.layout import RegionLayout, region_layout, transfer_layers
from transfer.mooncake import MooncakeEngine, Write
from transfer.pack import unpack_layer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reservation:
    tokens: int
    slice: Slice
    regions: dict[int, tuple[int, RegionLayout]]  # layer -> (offset in the arena, layout)
    deadline: float  # monotonic: after this (plus the arena's margin) no write can land

    @property
    def nbytes(self) -> int:
        return self.slice.nbytes


class KVReceiver:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, engine: MooncakeEngine, arena_bytes: int,
                 device: torch.device | str = "cpu", late_write_margin_s: float = 5.0):
        self.cfg, self.dtype, self.engine = cfg, dtype, engine
        self.layers = transfer_layers(cfg)
        self.arena = Arena(arena_bytes, device, late_write_margin_s)
        engine.register(self.arena.buffer)
        self._warm_up()

    def _warm_up(self) -> None:
        """One write to ourselves: the first transfer pays the handshake and first-touch costs, not a request."""
        probe = self.arena.allocate(4096)
        try:
            src = self.arena.buffer.data_ptr() + probe.offset
            self.engine.write(self.engine.session, [Write(src, src, 64)])
        finally:
            self.arena.release(probe, safe=True)

    def request_bytes(self, tokens: int) -> int:
        return sum(region_layout(self.cfg, layer, tokens, self.dtype).nbytes for layer in self.layers)

    def reserve(self, tokens: int, timeout_s: float) -> Reservation:
        layouts = [region_layout(self.cfg, layer, tokens, self.dtype) for layer in self.layers]
        s = self.arena.allocate(sum(lay.nbytes for lay in layouts))
        regions, off = {}, s.offset
        for lay in layouts:
            regions[lay.layer] = (off, lay)
            off += lay.nbytes
        return Reservation(tokens, s, regions, time.monotonic() + timeout_s)

    def destination(self, res: Reservation) -> prefill_pb2.Destination:
        base = self.arena.base
        return prefill_pb2.Destination(session=self.engine.session, regions=[
            prefill_pb2.Region(layer=layer, address=base + off, nbytes=lay.nbytes)
            for layer, (off, lay) in res.regions.items()])

    def region(self, res: Reservation, layer: int) -> torch.Tensor:
        off, lay = res.regions[layer]
        return self.arena.buffer[off:off + lay.nbytes]

    def unpack(self, res: Reservation, pool: CachePool, slot: int, tables: dict[int, list[int]]) -> None:
        """Copy the landed regions into the pool (layers the pool does not keep, e.g. the drafter's when decoding
        without speculation, are skipped); returns once the copies are done, so the slice can be reused."""
        for layer, (_, lay) in res.regions.items():
            if layer not in pool.swa:
                continue
            r = self.cfg.ratio(layer) if layer < self.cfg.num_hidden_layers else 0
            unpack_layer(pool, lay, slot, tables.get(r, []), self.region(res, layer))
        if self.arena.buffer.is_cuda:
            torch.cuda.current_stream(self.arena.buffer.device).synchronize()  # a transfer may reuse it next

    def release(self, res: Reservation, safe: bool) -> None:
        """safe: prefill reported completion or acknowledged a cancel; otherwise quarantine until the deadline."""
        self.arena.release(res.slice, safe=safe, deadline=res.deadline)
