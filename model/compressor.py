"""The KV compressor of CSA/HCA layers (also used, narrower, inside the lightning indexer).

Each token contributes a projected kv row and a gate row. A compressed entry w summarises the window of tokens
[w*r, (w+1)*r) (HCA, r = 128) or, for CSA (r = 4, `overlap`), the previous window's first half-channels together
with this window's second half-channels: a softmax over the window (gate + learned position bias `ape`), a
weighted sum, RMSNorm and rope at the window's start position.

`extend` computes the entries that complete while a request grows from L to L+K tokens, from the carried
projections of the last `carry_len` tokens plus the K new ones. It does not know where state is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import RMSNorm, Rope, apply_rope
from .quant import fp4_roundtrip, fp8_roundtrip, hadamard

NO_SIM, FP8_NOPE, HADAMARD_FP4 = None, "fp8_nope", "hadamard_fp4"


@dataclass(frozen=True, slots=True)
class CompressorOut:
    entries: torch.Tensor  # [B, E, d] new entries for windows L//r + e (complete or not; callers mask)
    seq_kv: torch.Tensor  # [B, C+K, cw] carried + new kv projections (positions L-C ..), for commit
    seq_gate: torch.Tensor  # [B, C+K, cw] same for the gate projections


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float, rope: Rope,
                 sim: str | None = NO_SIM):
        super().__init__()
        self.ratio, self.overlap, self.head_dim, self.sim = ratio, overlap, head_dim, sim
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)
        self.rope = rope  # shared, not owned: its buffers live on the attention module

    @property
    def span(self) -> int:
        """Tokens that feed one entry."""
        return self.ratio * (2 if self.overlap else 1)

    @property
    def carry_len(self) -> int:
        """Tokens of projections a request must carry between calls: the longest partial span."""
        return self.span - 1

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, K, H] -> kv, gate [B, K, width] fp32."""
        return self.wkv(x).float(), self.wgate(x).float()

    def extend(self, x: torch.Tensor, start: torch.Tensor, carry_kv: torch.Tensor, carry_gate: torch.Tensor
               ) -> CompressorOut:
        """x [B, K, H]; start [B] int64 (L); carry_* [B, C, width] fp32 for positions L-C .. L-1."""
        kv, gate = self.project(x)
        seq_kv, seq_gate = torch.cat((carry_kv, kv), 1), torch.cat((carry_gate, gate), 1)
        b, k = x.shape[:2]
        r, c = self.ratio, carry_kv.shape[1]
        n_new = k // r + 1
        w = (start // r)[:, None] + torch.arange(n_new, device=x.device)  # [B, E]
        t = torch.arange(self.span, device=x.device)
        src_pos = (w * r - (r if self.overlap else 0))[..., None] + t  # [B, E, span]
        src = (src_pos - (start - c)[:, None, None]).clamp(0, c + k - 1)
        kv_w = _gather_rows(seq_kv, src)  # [B, E, span, width]
        gate_w = _gather_rows(seq_gate, src)
        kv_w, gate_w = self._select_halves(kv_w, gate_w)
        gate_w = gate_w.masked_fill((src_pos < 0)[..., None], float("-inf"))
        pooled = (kv_w * gate_w.softmax(dim=2)).sum(2)
        entries = self.norm(pooled.to(x.dtype))
        cos, sin = self.rope.cos_sin(w * r)
        return CompressorOut(self._simulate(apply_rope(entries, cos, sin)), seq_kv, seq_gate)

    def _simulate(self, e: torch.Tensor) -> torch.Tensor:
        """The reference's quantisation-aware rounding of finished entries (see model/NOTES.md)."""
        if self.sim == FP8_NOPE:
            return nope_fp8_roundtrip(e, self.rope.dim)
        if self.sim == HADAMARD_FP4:
            return fp4_roundtrip(hadamard(e))
        return e

    def _select_halves(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the position bias; with overlap, slots t < r read the first half of the channels (previous
        window), slots t >= r the second half (this window)."""
        r, d = self.ratio, self.head_dim
        if not self.overlap:
            return kv, gate + self.ape
        ape = torch.cat((self.ape[:, :d], self.ape[:, d:]), 0)  # [2r, d]
        kv = torch.cat((kv[..., :r, :d], kv[..., r:, d:]), -2)
        gate = torch.cat((gate[..., :r, :d], gate[..., r:, d:]), -2) + ape
        return kv, gate


def _gather_rows(seq: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """seq [B, N, w], idx [B, E, S] int64 -> [B, E, S, w]."""
    b, e, s = idx.shape
    flat = torch.gather(seq, 1, idx.reshape(b, e * s, 1).expand(-1, -1, seq.shape[-1]))
    return flat.view(b, e, s, -1)


def nope_fp8_roundtrip(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """fp8 round trip of the channels before the trailing rope channels; the rope channels stay exact."""
    return torch.cat((fp8_roundtrip(x[..., :-rope_dim]), x[..., -rope_dim:]), -1)
