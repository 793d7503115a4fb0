"""The packed region: the bytes of one request's state for one layer, as they cross the wire.

Both services derive it from (config, layer, prompt tokens, cache dtype) alone. Pieces, each 64-byte aligned:
- every target layer: `swa` [W, D] cache dtype, the window ring (row i holds the position p < T with p % W == i);
- CSA/HCA layers: `carry_kv`, `carry_gate` [C, cw] fp32 (compressor projections of the last C tokens) and
  `entries` [T // r, D] cache dtype;
- CSA layers also `idx_carry_kv`, `idx_carry_gate` [C, 2 * Di] fp32 and `idx_entries` [T // 4, Di];
- drafter layers: `swa` [W, D], the context ring.
Shapes come from `model.cache.CachePool`, whose storage the pieces mirror row for row; nothing else is sent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from model.config import CSA, ModelConfig

ALIGN = 64
LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Piece:
    name: str
    offset: int  # bytes from the region start
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class RegionLayout:
    layer: int
    pieces: tuple[Piece, ...]
    nbytes: int

    def piece(self, name: str) -> Piece:
        return next(p for p in self.pieces if p.name == name)


def _shapes(cfg: ModelConfig, layer: int, tokens: int, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    w, d = cfg.sliding_window, cfg.head_dim
    out = [("swa", (w, d), dtype)]
    r = cfg.ratio(layer) if layer < cfg.num_hidden_layers else 0
    if r == 0:
        return out
    carry = cfg.carry_shape(layer)
    out += [("carry_kv", carry, torch.float32), ("carry_gate", carry, torch.float32),
            ("entries", (tokens // r, d), dtype)]
    if cfg.kind(layer) == CSA:
        icarry = cfg.carry_shape(layer, indexer=True)
        out += [("idx_carry_kv", icarry, torch.float32), ("idx_carry_gate", icarry, torch.float32),
                ("idx_entries", (tokens // r, cfg.index_head_dim), dtype)]
    return out


def region_layout(cfg: ModelConfig, layer: int, tokens: int, dtype: torch.dtype) -> RegionLayout:
    pieces, off = [], 0
    for name, shape, dt in _shapes(cfg, layer, tokens, dtype):
        p = Piece(name, off, shape, dt)
        pieces.append(p)
        off += -(-p.nbytes // ALIGN) * ALIGN
    return RegionLayout(layer, tuple(pieces), off)


def transfer_layers(cfg: ModelConfig) -> list[int]:
    """Every layer whose state crosses the wire: the target's, then the drafter's."""
    drafter = [cfg.num_hidden_layers + i for i in range(cfg.dspark_num_layers)]
    return list(range(cfg.num_hidden_layers)) + drafter


def request_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    return sum(region_layout(cfg, lyr, tokens, dtype).nbytes for lyr in transfer_layers(cfg))


def layout_hash(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """Identifies the layout function: equal hashes mean both sides pack and unpack the same bytes."""
    probe = {str(lyr): [(p.name, p.offset, list(p.shape), str(p.dtype))
                        for p in region_layout(cfg, lyr, 1000, dtype).pieces] for lyr in transfer_layers(cfg)}
    desc = {"version": LAYOUT_VERSION, "align": ALIGN, "qat_sim": cfg.qat_sim, "layers": probe,
            "vocab": cfg.vocab_size, "hidden": cfg.hidden_size}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
