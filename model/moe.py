"""Mixture of experts: the V4 router (hash or bias-corrected top-k) and clamped SwiGLU experts.

Position-wise: every token is routed independently. Padding rows (`is_padding`) get weight 0 and expert id -1,
so they select no expert and add nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.router import route

from .config import ModelConfig


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """The shared expert: w2(swiglu(w1 x, w3 x))."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(-1)


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, is_padding: torch.Tensor):
        """x [T, H], input_ids [T], is_padding [T] bool -> (weights [T, k] fp32, ids [T, k] int64)."""
        scores = score(F.linear(x.float(), self.weight.float()), self.cfg.scoring_func)
        hash_ids = self.tid2eid[input_ids] if self.hashed else None
        bias = None if self.hashed else self.bias
        return route(scores, bias, hash_ids, is_padding, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob,
                     self.cfg.routed_scaling_factor)


class Experts(nn.Module):
    """Routed experts stored stacked: w1/w3 [E, I, H], w2 [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Parameter(torch.zeros(e, i, h))
        self.w2 = nn.Parameter(torch.zeros(e, h, i))
        self.w3 = nn.Parameter(torch.zeros(e, i, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights/ids [T, k] -> [T, H]. Ids of -1 are skipped."""
        t, k, e = x.shape[0], ids.shape[1], self.w1.shape[0]
        # decode-sized batches on the GPU (and anything being captured in a CUDA graph) take the dense path: nearly
        # every expert is hit anyway; prefill-sized ones would waste E/k times the FLOPs there
        if x.is_cuda and (torch.cuda.is_current_stream_capturing() or (t * k >= e and t <= 512)):
            return self.dense(x, weights, ids)
        return self.sparse(x, weights, ids)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (0 for unselected): static shapes and no host sync,
        so it can be captured in a CUDA graph. At decode batch sizes nearly every expert is hit anyway, so the
        weight traffic, which bounds the step, is the same as the sparse path's."""
        n_exp = self.w1.shape[0]
        dense_w = torch.zeros(x.shape[0], n_exp + 1, dtype=torch.float32, device=x.device)
        dense_w.scatter_add_(1, ids.masked_fill(ids < 0, n_exp), weights.float())
        g = torch.einsum("th,eih->eti", x, self.w1)
        u = torch.einsum("th,eih->eti", x, self.w3)
        h = torch.einsum("eti,ehi->eth", swiglu(g, u, self.limit), self.w2)
        return torch.einsum("eth,te->th", h.float(), dense_w[:, :n_exp]).to(x.dtype)

    def sparse(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=self.w1.shape[0]).tolist()
        start = int((flat_ids < 0).sum())  # -1 ids sort first
        k = ids.shape[1]
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok = sel // k
            h = swiglu(x[tok] @ self.w1[e].T, x[tok] @ self.w3[e].T, self.limit) @ self.w2[e].T
            out.index_add_(0, tok, h.float() * weights.flatten()[sel, None])
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        """x [..., H]; input_ids / is_padding [...] -> [..., H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat, input_ids.reshape(-1), is_padding.reshape(-1))
        out = self.experts(flat, weights, ids) + self.shared_experts(flat)
        return out.view(shape)
