"""The DSpark drafter for DeepSeek-V4 targets (checkpoint keys `mtp.{i}.*`).

- Context: the target's residual streams after each of `dspark_target_layer_ids`, averaged over the hc streams and
  concatenated, go through `main_proj` + `main_norm` (on stage 0) into `main_x`; each drafter stage derives its
  context KV from `main_x` with its own kv path (wkv, kv_norm, rope). `ContextKV` is that part alone, the
  *context-KV-only* drafter the prefill side builds (no experts, heads or embedding).
- Drafting (`Drafter`): a block [anchor, noise x (b-1)] at positions L..L+b-1 goes through the stages (V4 decoder
  blocks with sliding-window attention over the context and non-causal attention inside the block, non-hash MoE,
  mHC), then `hc_head` -> `norm` -> the target's head gives base logits; the Markov head adds a low-rank bias from
  the previous token while the block is sampled left to right; the confidence head scores each position.

The embedding and LM head are the target's, passed in at call time (never copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .layers import HyperConnection, HyperHead, RMSNorm, Rope
from .target import Block


def drafter_layer_ids(cfg: ModelConfig) -> list[int]:
    return [cfg.num_hidden_layers + i for i in range(cfg.dspark_num_layers)]


def aux_features(aux: dict[int, torch.Tensor], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Target streams {layer: [B, K, hc, H]} -> [B, K, len(ids) * H]: the hc-mean of each, concatenated."""
    return torch.cat([aux[i].float().mean(-2) for i in layer_ids], -1)


class ContextStage(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, first: bool):
        super().__init__()
        self.attn = _KVOnlyAttention(cfg, layer)
        if first:
            self.main_proj = nn.Linear(cfg.hidden_size * len(cfg.dspark_target_layer_ids), cfg.hidden_size, bias=False)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _KVOnlyAttention(nn.Module):
    """wkv + kv_norm + rope of a sliding-window attention, nothing else."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None)

    project_kv = Attention.project_kv


def main_x(stage0: nn.Module, cfg: ModelConfig, aux: dict[int, torch.Tensor]) -> torch.Tensor:
    feats = aux_features(aux, cfg.dspark_target_layer_ids).to(stage0.main_proj.weight.dtype)
    return stage0.main_norm(stage0.main_proj(feats))


def context_kv(stages: nn.ModuleList, cfg: ModelConfig, aux: dict[int, torch.Tensor], positions: torch.Tensor
               ) -> list[torch.Tensor]:
    """Context KV rows [B, K, D] per drafter stage for target positions [B, K] (aux: target streams there)."""
    x = main_x(stages[0], cfg, aux)
    cos, sin = stages[0].attn.rope.cos_sin(positions)
    return [s.attn.project_kv(x, cos, sin) for s in stages]


class _Stages(nn.Module):
    """`mtp.{i}` stages built by make_stage(cfg, layer id, first, last); inference only."""

    def __init__(self, cfg: ModelConfig, make_stage):
        super().__init__()
        if not cfg.has_dspark:
            raise ValueError("the checkpoint's config has no DSpark drafter (dspark_target_layer_ids)")
        self.cfg = cfg
        self.layer_ids = drafter_layer_ids(cfg)
        n = len(self.layer_ids)
        self.mtp = nn.ModuleList(make_stage(cfg, lid, i == 0, i == n - 1) for i, lid in enumerate(self.layer_ids))
        self.requires_grad_(False)


class ContextKV(_Stages):
    """The context-KV-only drafter (prefill side): main_proj/main_norm and each stage's kv path."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, lambda c, lid, first, last: ContextStage(c, lid, first))

    def forward(self, aux: dict[int, torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
        return context_kv(self.mtp, self.cfg, aux, positions)


class DraftStage(Block):
    def __init__(self, cfg: ModelConfig, layer: int, first: bool, last: bool):
        super().__init__(cfg, layer)
        if first:
            self.main_proj = nn.Linear(cfg.hidden_size * len(cfg.dspark_target_layer_ids), cfg.hidden_size, bias=False)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hc_head = HyperHead(cfg)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank)

    def draft(self, streams, input_ids, positions, start, context, is_padding):
        x, post, comb = self.hc_attn.collapse(streams)
        out = self.attn.draft(self.attn_norm(x), positions, start, context)
        streams = HyperConnection.expand(out, streams, post, comb)
        x, post, comb = self.hc_ffn.collapse(streams)
        pad = is_padding[:, None].expand_as(input_ids)
        return HyperConnection.expand(self.ffn(self.ffn_norm(x), input_ids, pad), streams, post, comb)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] int64 -> transition bias [B, V] fp32."""
        return self.markov_w2(self.markov_w1(prev)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat((hidden.float(), markov_embed.float()), -1)  # in fp32 whatever the weights' dtype
        return torch.sigmoid(F.linear(x, self.proj.weight.float())).squeeze(-1)


class Drafter(_Stages):
    """The full drafter (decode side)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DraftStage)

    @property
    def last(self) -> DraftStage:
        return self.mtp[-1]

    def context_kv(self, aux: dict[int, torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
        return context_kv(self.mtp, self.cfg, aux, positions)

    def block_hidden(self, embed: nn.Embedding, anchor: torch.Tensor, start: torch.Tensor,
                     contexts: list[torch.Tensor], is_padding: torch.Tensor) -> torch.Tensor:
        """anchor [B] at position start [B]; contexts: per stage ring [B, W, D] -> pre-norm hidden [B, b, H]."""
        b = self.cfg.dspark_block_size
        ids = torch.full((anchor.shape[0], b), self.cfg.dspark_noise_token_id, dtype=torch.int64,
                         device=anchor.device)
        ids[:, 0] = anchor
        positions = start[:, None] + torch.arange(b, device=anchor.device)
        h = embed(ids)
        streams = h.unsqueeze(-2).expand(*h.shape[:-1], self.cfg.hc_mult, h.shape[-1]).contiguous()
        for stage, ctx in zip(self.mtp, contexts):
            streams = stage.draft(streams, ids, positions, start, ctx, is_padding)
        return self.last.hc_head(streams)

    def base_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.last.norm(hidden), head.weight).float()
