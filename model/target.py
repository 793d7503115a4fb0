"""The DeepSeek-V4 target model: embedding, decoder blocks (attention + MoE inside mHC), hc_head, norm, head.

Two entry points over the same weights:
- `forward(input_ids)`: a stateless full forward, logits for every position (the reference the rest must equal).
- `extend(batch, cache)`: requests holding state grow by K tokens each; returns the new positions' hidden states
  and the pending state the caller commits (`model.cache`). Prefill chunks, decode steps and speculative
  verification are all `extend`.

A model may hold only a contiguous range of layers (a pipeline stage); the embedding lives with layer 0 and the
head with the last layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Attention, LayerPending, LayerView
from .config import ModelConfig
from .layers import HyperConnection, HyperHead, RMSNorm
from .moe import MoE


@dataclass(frozen=True, slots=True)
class StepBatch:
    """B requests, each adding K tokens. Padding rows use slot 0, block 0 and start 0."""

    input_ids: torch.Tensor  # [B, K] int64
    start: torch.Tensor  # [B] int64, tokens already held in state
    is_padding: torch.Tensor  # [B] bool
    slots: torch.Tensor | None = None  # [B] int64 cache slot (None: no cache, start must be 0)
    tables: dict[int, torch.Tensor] = field(default_factory=dict)  # ratio -> [B, n_blocks] int64 block table

    @property
    def positions(self) -> torch.Tensor:  # [B, K] int64; zero on padding rows
        pos = self.start[:, None] + torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return pos.masked_fill(self.is_padding[:, None], 0)

    @staticmethod
    def fresh(input_ids: torch.Tensor) -> "StepBatch":
        b = input_ids.shape[0]
        zeros = torch.zeros(b, dtype=torch.int64, device=input_ids.device)
        return StepBatch(input_ids, zeros, torch.zeros(b, dtype=torch.bool, device=input_ids.device))


@dataclass(slots=True)
class ExtendOut:
    streams: torch.Tensor  # [B, K, hc, H] residual streams after the last held layer
    pending: dict[int, LayerPending]  # layer -> what the K tokens add to its state
    aux: dict[int, torch.Tensor]  # layer -> [B, K, hc, H] streams after that layer (captured on request)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, cfg.is_hash_layer(layer))
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    def extend(self, streams: torch.Tensor, batch: StepBatch, positions: torch.Tensor, view: LayerView
               ) -> tuple[torch.Tensor, LayerPending]:
        """streams [B, K, hc, H] -> (streams, pending)."""
        x, post, comb = self.hc_attn.collapse(streams)
        out, pending = self.attn.extend(self.attn_norm(x), positions, batch.start, view)
        streams = HyperConnection.expand(out, streams, post, comb)
        x, post, comb = self.hc_ffn.collapse(streams)
        pad = batch.is_padding[:, None].expand_as(batch.input_ids)
        out = self.ffn(self.ffn_norm(x), batch.input_ids, pad)
        return HyperConnection.expand(out, streams, post, comb), pending


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: range | None = None):
        super().__init__()
        self.cfg = cfg
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        self.has_embed = self.layer_range.start == 0
        self.has_head = self.layer_range.stop == cfg.num_hidden_layers
        if self.has_embed:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in self.layer_range})
        if self.has_head:
            self.hc_head = HyperHead(cfg)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)  # inference only

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[str(self.layer_range.start)].attn.wkv.weight.dtype

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, K] int64 -> [B, K, hc, H]: the embedding copied into every residual stream."""
        h = self.embed(input_ids)
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.cfg.hc_mult, h.shape[-1]).contiguous()

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[..., hc, H] -> [..., H] after hc_head and the final norm."""
        return self.norm(self.hc_head(streams))

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_hidden(streams)).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full forward of whole sequences: input_ids [B, S] int64 -> logits [B, S, vocab] fp32."""
        out = self.extend(StepBatch.fresh(input_ids.to(self.device)), cache=None)
        return self.logits(out.streams)

    def extend(self, batch: StepBatch, cache=None, streams: torch.Tensor | None = None,
               capture: tuple[int, ...] = (), on_layer=None) -> ExtendOut:
        """Run the held layers over K new tokens per request.

        cache: a `model.cache.CachePool` holding the requests' state, or None for requests with no history.
        streams: [B, K, hc, H] input from the previous pipeline stage (None on the stage holding layer 0).
        on_layer(layer, pending): called as each layer finishes (a prefill stage commits and ships it there)."""
        if streams is None:
            streams = self.embed_streams(batch.input_ids)
        positions = batch.positions
        pending, aux = {}, {}
        for i in self.layer_range:
            view = cache.read(i, batch) if cache is not None else empty_view(self.cfg, i, batch, self.dtype)
            streams, pending[i] = self.layers[str(i)].extend(streams, batch, positions, view)
            if on_layer is not None:
                on_layer(i, pending[i])
            if i in capture:
                aux[i] = streams
        return ExtendOut(streams, pending, aux)


def empty_view(cfg: ModelConfig, layer: int, batch: StepBatch, dtype: torch.dtype) -> LayerView:
    """The state of requests that hold no tokens yet."""
    b, dev, d = batch.input_ids.shape[0], batch.input_ids.device, cfg.head_dim
    swa = torch.zeros(b, cfg.sliding_window, d, device=dev, dtype=dtype)
    ratio = cfg.ratio(layer)
    if ratio == 0:
        return LayerView(swa=swa)
    carry = torch.zeros(b, *cfg.carry_shape(layer), device=dev, dtype=torch.float32)
    entries = torch.zeros(b, 0, d, device=dev, dtype=dtype)
    if ratio != 4:
        return LayerView(swa=swa, carry_kv=carry, carry_gate=carry, entries=entries)
    di = cfg.index_head_dim
    icarry = torch.zeros(b, *cfg.carry_shape(layer, indexer=True), device=dev, dtype=torch.float32)
    return LayerView(swa=swa, carry_kv=carry, carry_gate=carry, entries=entries, idx_carry_kv=icarry,
                     idx_carry_gate=icarry, idx_entries=torch.zeros(b, 0, di, device=dev, dtype=dtype))
