"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus, for CSA/HCA layers, compressed entries.

One `extend` serves every execution path: a request holding L tokens of state grows by K tokens (a whole prompt
from L = 0, a prefill chunk, one decode token, or b+1 verification tokens). It reads a `LayerView` of the
request's state and returns the outputs plus a `LayerPending` of what those K tokens would add to the state;
nothing is written here (`model.cache` commits the accepted prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .compressor import FP8_NOPE, HADAMARD_FP4, NO_SIM, Compressor, CompressorOut, nope_fp8_roundtrip
from .config import CSA, ModelConfig, SWA
from .layers import RMSNorm, Rope, apply_rope, rms_normalize
from .quant import fp4_roundtrip, hadamard

NEVER = 1 << 40  # entry index that no query can see


@dataclass(frozen=True, slots=True)
class LayerView:
    """What one layer reads of a batch's state (gathered by `model.cache`)."""

    swa: torch.Tensor  # [B, W, D]; ring row i holds the token at the latest position p < L with p % W == i
    carry_kv: torch.Tensor | None = None  # [B, C, cw] fp32 compressor projections of positions L-C .. L-1
    carry_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [B, M, D] compressed entries 0 .. M-1 (valid below L // r)
    idx_carry_kv: torch.Tensor | None = None  # CSA indexer: same at index_head_dim
    idx_carry_gate: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None  # [B, M, Di]


@dataclass(frozen=True, slots=True)
class LayerPending:
    """What K new tokens would add to a layer's state; `model.cache.commit` keeps an accepted prefix."""

    kv: torch.Tensor  # [B, K, D] window rows
    comp: CompressorOut | None = None
    idx: CompressorOut | None = None


class Indexer(nn.Module):
    """Lightning indexer: scores compressed entries per query, sum_h w_h * relu(q_h . k), keeps the top-k."""

    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.sim = cfg.qat_sim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, True, cfg.rms_norm_eps, rope,
                                     HADAMARD_FP4 if cfg.qat_sim else NO_SIM)
        self.rope = rope

    def select(self, x, q_low, cos, sin, keys, visible):
        """x [B,K,H], q_low [B,K,q_lora], keys [B,M,Di], visible [B,K,M] bool -> selected [B,K,M] bool."""
        b, k = x.shape[:2]
        q = apply_rope(self.wq_b(q_low).view(b, k, self.n_heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        if self.sim:
            q = fp4_roundtrip(hadamard(q))
        w = self.weights_proj(x).float() * self.n_heads ** -0.5  # [B, K, h]
        s = torch.relu(torch.einsum("bkhd,bmd->bkhm", q.float(), keys.float())) * self.head_dim ** -0.5
        scores = (s * w[..., None]).sum(2).masked_fill(~visible, float("-inf"))
        n = min(self.topk, scores.shape[-1])
        if n == scores.shape[-1]:
            return visible
        # ties are common (relu zeros): a stable sort over the reversed entries gives them to the latest entry,
        # the same way on every path whatever the padding between entries
        m = scores.shape[-1]
        top = m - 1 - torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :n]
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.kind, self.ratio = cfg, cfg.kind(layer), cfg.ratio(layer)
        h, d, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.n_heads, self.head_dim, self.window = nh, d, cfg.sliding_window
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, nh * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(nh * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(nh, dtype=torch.float32))
        if self.kind == SWA:
            self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        else:
            self.rope = Rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn)
            self.compressor = Compressor(h, d, self.ratio, self.kind == CSA, cfg.rms_norm_eps, self.rope,
                                         FP8_NOPE if cfg.qat_sim else NO_SIM)
            if self.kind == CSA:
                self.indexer = Indexer(cfg, self.rope)

    def extend(self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, view: LayerView
               ) -> tuple[torch.Tensor, LayerPending]:
        """x [B, K, H] normed input; positions [B, K] = start[:, None] + arange(K); start [B] int64."""
        cos, sin = self.rope.cos_sin(positions)  # [B, K, r/2]
        q, q_low = self.project_q(x, cos, sin)
        kv = self.project_kv(x, cos, sin)  # [B, K, D]
        keys = torch.cat((view.swa, kv), 1)  # [B, W+K, D]
        key_pos = torch.cat((ring_positions(start, self.window), positions), 1)
        qp, kp = positions[:, :, None], key_pos[:, None, :]
        mask = (kp >= 0) & (kp <= qp) & (kp > qp - self.window)  # [B, K, W+K]
        pending = LayerPending(kv=kv)
        if self.kind != SWA:
            entries, visible, pending = self._compressed(x, q_low, cos, sin, positions, start, view, kv)
            keys, mask = torch.cat((keys, entries), 1), torch.cat((mask, visible), 2)
        return self._attend_out(q, keys, mask, cos, sin), pending

    def draft(self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, context: torch.Tensor
              ) -> torch.Tensor:
        """A DSpark query block: x [B, K, H] at positions start..start+K-1 attends to the context ring [B, W, D]
        (rows of positions < start, within each query's window) and to every token of its own block."""
        cos, sin = self.rope.cos_sin(positions)
        q, _ = self.project_q(x, cos, sin)
        kv = self.project_kv(x, cos, sin)
        ctx_pos = ring_positions(start, self.window)[:, None, :]  # [B, 1, W]
        ctx_mask = (ctx_pos >= 0) & (ctx_pos > positions[:, :, None] - self.window)
        block_mask = torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        return self._attend_out(q, torch.cat((context, kv), 1), torch.cat((ctx_mask, block_mask), 2), cos, sin)

    def project_q(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [B, K, nh, D] (per-head normed, roped), q_low [B, K, q_lora] (shared with the indexer)."""
        b, k, _ = x.shape
        q_low = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_low).view(b, k, self.n_heads, self.head_dim)
        q = rms_normalize(q.float(), self.cfg.rms_norm_eps).to(x.dtype)
        return apply_rope(q, cos[:, :, None], sin[:, :, None]), q_low

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The shared K=V row of each token [B, K, D]: normed, roped, fp8-simulated (nope channels)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return nope_fp8_roundtrip(kv, self.rope.dim) if self.cfg.qat_sim else kv

    def _attend_out(self, q, keys, mask, cos, sin) -> torch.Tensor:
        out = attend_with_sink(q, keys, mask, self.attn_sink, self.head_dim ** -0.5)  # [B, K, nh, D]
        return self._project_out(apply_rope(out, cos[:, :, None], sin[:, :, None], inverse=True))

    def _compressed(self, x, q_low, cos, sin, positions, start, view, kv):
        r = self.ratio
        comp = self.compressor.extend(x, start, view.carry_kv, view.carry_gate)
        entry_w = entry_indices(start, r, view.entries.shape[1], comp.entries.shape[1])  # [B, M+E]
        visible = entry_w[:, None, :] < ((positions + 1) // r)[:, :, None]  # [B, K, M+E]
        entries = torch.cat((view.entries, comp.entries), 1)
        idx = None
        if self.kind == CSA:
            idx = self.indexer.compressor.extend(x, start, view.idx_carry_kv, view.idx_carry_gate)
            keys = torch.cat((view.idx_entries, idx.entries), 1)
            visible = self.indexer.select(x, q_low, cos, sin, keys, visible)
        return entries, visible, LayerPending(kv=kv, comp=comp, idx=idx)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        b, k = out.shape[:2]
        g = self.cfg.o_groups
        grouped = out.reshape(b, k, g, -1)
        wo_a = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)
        low = torch.einsum("bkgi,gri->bkgr", grouped, wo_a)
        return self.wo_b(low.flatten(2))


def ring_positions(start: torch.Tensor, window: int) -> torch.Tensor:
    """start [B] -> [B, W] position held by each ring row (negative when the row holds nothing yet)."""
    i = torch.arange(window, device=start.device)
    last = start[:, None] - 1
    return last - torch.remainder(last - i, window)


def entry_indices(start: torch.Tensor, ratio: int, n_old: int, n_new: int) -> torch.Tensor:
    """Window index of each entry slot: old slots j (NEVER beyond the request's L // r), then L // r + e."""
    done = start // ratio
    old = torch.arange(n_old, device=start.device).expand(start.shape[0], -1)
    old = torch.where(old < done[:, None], old, torch.full_like(old, NEVER))
    new = done[:, None] + torch.arange(n_new, device=start.device)
    return torch.cat((old, new), 1)


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B,K,h,D], keys=values [B,N,D], mask [B,K,N] bool, sink [h] -> [B,K,h,D].

    The sink is an extra logit per head that takes probability mass and contributes no value."""
    logits = torch.einsum("bkhd,bnd->bhkn", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink_col = sink.view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
    probs = torch.cat((logits, sink_col), -1).softmax(-1)[..., :-1]
    return torch.einsum("bhkn,bnd->bkhd", probs, keys.float()).to(q.dtype)
