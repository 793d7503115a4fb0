"""Per-layer request state on the device: the storage `Transformer.extend` reads and `commit` writes.

Per layer:
- `swa`   [slots, W+1, D]: each request's ring of window rows; row W is a junk row absorbing discarded writes.
- `carry` [slots, C, cw] fp32 (kv and gate): compressor projections of the last C tokens (CSA/HCA layers).
- `entries` [blocks, block_size, D]: compressed entries, paged; a request owns a block table per ratio, so its
  memory grows with the tokens it holds. CSA layers also page indexer keys and carry indexer projections.
Slot 0 and block 0 are scratch: padding rows read and write there.

This module knows nothing about which request owns which slot or block (`engine.allocator` does).
"""

from __future__ import annotations

import torch

from .attention import LayerPending, LayerView
from .compressor import CompressorOut
from .config import CSA, ModelConfig
from .target import StepBatch

SCRATCH = 0


class CachePool:
    def __init__(self, cfg: ModelConfig, layers, num_slots: int, num_blocks: dict[int, int],
                 block_size: int, device: torch.device | str, dtype: torch.dtype):
        """layers: target layer ids (and drafter layer ids, whose context rings are sliding-window state);
        num_slots and num_blocks include the scratch slot / block 0."""
        self.cfg, self.layers, self.block_size = cfg, layers, block_size
        self.num_slots, self.num_blocks = num_slots, dict(num_blocks)
        w, d, di = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
        z = dict(device=device)
        self.swa, self.carry_kv, self.carry_gate, self.entries = {}, {}, {}, {}
        self.idx_carry_kv, self.idx_carry_gate, self.idx_entries = {}, {}, {}
        for i in layers:
            self.swa[i] = torch.zeros(num_slots, w + 1, d, dtype=dtype, **z)
            r = cfg.ratio(i)
            if r == 0:
                continue
            overlap = cfg.kind(i) == CSA
            self.carry_kv[i] = torch.zeros(num_slots, *cfg.carry_shape(i), dtype=torch.float32, **z)
            self.carry_gate[i] = torch.zeros_like(self.carry_kv[i])
            self.entries[i] = torch.zeros(num_blocks[r], block_size, d, dtype=dtype, **z)
            if overlap:
                self.idx_carry_kv[i] = torch.zeros(num_slots, *cfg.carry_shape(i, indexer=True), dtype=torch.float32,
                                                   **z)
                self.idx_carry_gate[i] = torch.zeros_like(self.idx_carry_kv[i])
                self.idx_entries[i] = torch.zeros(num_blocks[r], block_size, di, dtype=dtype, **z)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every storage tensor by a stable name (for registration with a transfer engine, and for tests)."""
        out = {}
        for name in ("swa", "carry_kv", "carry_gate", "entries", "idx_carry_kv", "idx_carry_gate", "idx_entries"):
            for i, t in getattr(self, name).items():
                out[f"{name}.{i}"] = t
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's fixed-size state (so a reused slot starts like a fresh request)."""
        for name in ("swa", "carry_kv", "carry_gate", "idx_carry_kv", "idx_carry_gate"):
            for t in getattr(self, name).values():
                t[slot].zero_()

    # ---- read --------------------------------------------------------------------------------------
    def read(self, layer: int, batch: StepBatch) -> LayerView:
        w = self.cfg.sliding_window
        swa = self.swa[layer][batch.slots, :w]
        r = self.cfg.ratio(layer)
        if r == 0:
            return LayerView(swa=swa)
        view = dict(swa=swa, carry_kv=self.carry_kv[layer][batch.slots],
                    carry_gate=self.carry_gate[layer][batch.slots],
                    entries=self._gather(self.entries[layer], batch.tables[r]))
        if self.cfg.kind(layer) == CSA:
            view.update(idx_carry_kv=self.idx_carry_kv[layer][batch.slots],
                        idx_carry_gate=self.idx_carry_gate[layer][batch.slots],
                        idx_entries=self._gather(self.idx_entries[layer], batch.tables[r]))
        return LayerView(**view)

    @staticmethod
    def _gather(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """pool [blocks, bs, d], table [B, nb] -> [B, nb*bs, d] (entry j of a request at row j)."""
        return pool[table].flatten(1, 2)

    # ---- commit ------------------------------------------------------------------------------------
    def commit(self, batch: StepBatch, pending: dict[int, LayerPending], accepted: torch.Tensor,
               memo: dict | None = None) -> None:
        """Keep the first accepted[b] of the K pending tokens of each request; the rest leave no trace.

        The write positions depend only on the batch, the counts and the layer's kind, so they are computed once
        per kind and reused across layers (`memo`, shared by the calls of one step); each layer then costs only its
        scatters, which matters where every operation is a kernel launch."""
        memo = {} if memo is None else memo
        for layer, p in pending.items():
            self.commit_rows(layer, batch, p.kv, accepted, memo)
            r = self.cfg.ratio(layer)
            if r == 0:
                continue
            self._commit_compressor(batch, p.comp, accepted, r, self.carry_kv[layer], self.carry_gate[layer],
                                    self.entries[layer], memo)
            if p.idx is not None:
                self._commit_compressor(batch, p.idx, accepted, r, self.idx_carry_kv[layer],
                                        self.idx_carry_gate[layer], self.idx_entries[layer], memo)

    def commit_rows(self, layer: int, batch: StepBatch, kv: torch.Tensor, accepted: torch.Tensor,
                    memo: dict | None = None) -> None:
        """Write the first accepted[b] of kv [B, K, D] (positions start..) into the layer's window ring."""
        def positions():
            w, k = self.cfg.sliding_window, kv.shape[1]
            j = torch.arange(k, device=kv.device)[None]
            n = accepted[:, None]
            keep = (j < n) & (j >= n - w)
            row = torch.where(keep, (batch.start[:, None] + j) % w, torch.full_like(j, w))
            return (batch.slots[:, None] * (w + 1) + row).flatten()
        flat = _memoised(memo, ("rows", kv.shape[1]), positions)
        self.swa[layer].view(-1, kv.shape[-1]).index_put_((flat,), kv.flatten(0, 1))

    def _commit_compressor(self, batch: StepBatch, out: CompressorOut, accepted: torch.Tensor, r: int,
                           carry_kv: torch.Tensor, carry_gate: torch.Tensor, pool: torch.Tensor,
                           memo: dict | None = None) -> None:
        c, e = carry_kv.shape[1], out.entries.shape[1]

        def positions():
            idx = (accepted[:, None] + torch.arange(c, device=accepted.device))[..., None]  # [B, C, 1]
            bs = self.block_size
            table = batch.tables[r]
            w = (batch.start // r)[:, None] + torch.arange(e, device=accepted.device)  # [B, E]
            done = (w + 1) * r <= (batch.start + accepted)[:, None]
            block = torch.gather(table, 1, (w // bs).clamp(max=table.shape[1] - 1))
            return idx, torch.where(done, block * bs + w % bs, torch.full_like(w, SCRATCH * bs)).flatten()
        idx, dest = _memoised(memo, ("compressor", r, c, e), positions)
        carry_kv[batch.slots] = torch.gather(out.seq_kv, 1, idx.expand(-1, -1, out.seq_kv.shape[-1]))
        carry_gate[batch.slots] = torch.gather(out.seq_gate, 1, idx.expand(-1, -1, out.seq_gate.shape[-1]))
        pool.view(-1, pool.shape[-1]).index_put_((dest,), out.entries.flatten(0, 1))


def _memoised(memo: dict | None, key, make):
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def ratios_of(cfg: ModelConfig, layers: range) -> tuple[int, ...]:
    return tuple(sorted({cfg.ratio(i) for i in layers} - {0}))


