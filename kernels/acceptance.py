"""Speculative acceptance: greedy match and standard rejection sampling in one rule.

For each request, draft i (i < b) is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the correction is drawn from normalise(max(0, p_i - q_i)); when all b are accepted, a bonus token is drawn from
p_b. With one-hot p and q (temperature 0) this is exactly the greedy rule: accept while d_i == argmax p_i, then emit
argmax. Uniforms come from the caller (counter-based, so the result is reproducible).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, use_triton


def accept_ref(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
               u_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, b+1, V] target probs, q [B, b, V] draft probs, drafts [B, b] int64, u_accept [B, b], u_sample [B]
    -> (n_accepted [B] int64, correction-or-bonus token [B] int64)."""
    bsz, b = drafts.shape
    pd = p[:, :b].gather(-1, drafts[..., None]).squeeze(-1)
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    ok = u_accept * qd < pd  # u < p/q without dividing (q(d) > 0 for a sampled draft)
    n = torch.where(ok.all(-1), torch.full_like(drafts[:, 0], b), (~ok).long().argmax(-1))
    rows = torch.arange(bsz, device=p.device)
    target = p[rows, n]  # [B, V]
    q_pad = torch.cat((q, torch.zeros_like(q[:, :1])), 1)
    residual = (target - q_pad[rows, n]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    dist = torch.where((n < b)[:, None] & (mass > 0), residual / mass.clamp(min=1e-30), target)
    cdf = dist.cumsum(-1)
    tok = torch.searchsorted(cdf, (u_sample[:, None] * cdf[:, -1:]).contiguous()).squeeze(-1)
    return n, tok.clamp(max=p.shape[-1] - 1)


@triton.jit
def _kernel(p_ptr, q_ptr, d_ptr, ua_ptr, us_ptr, n_ptr, tok_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr,
            NB: tl.constexpr):
    row = tl.program_id(0)
    n = row * 0 + NB  # first rejected draft (NB: none), a runtime scalar
    for i in range(NB):
        d = tl.load(d_ptr + row * NB + i)
        pd = tl.load(p_ptr + (row * (NB + 1) + i) * V + d)
        qd = tl.load(q_ptr + (row * NB + i) * V + d)
        u = tl.load(ua_ptr + row * NB + i)
        n = tl.where((n == NB) & (u * qd >= pd), i, n)
    p_row = p_ptr + (row * (NB + 1) + n) * V
    q_row = q_ptr + (row * NB + n) * V
    rejected = n < NB
    residual_mass = 0.0
    target_mass = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        pt = tl.load(p_row + offs, mask=m, other=0.0)
        qt = tl.load(q_row + offs, mask=m & ((offs * 0 + n) < NB), other=0.0)
        residual_mass += tl.sum(tl.maximum(pt - qt, 0.0), 0)
        target_mass += tl.sum(pt, 0)
    use_residual = rejected & (residual_mass > 0)
    threshold = tl.load(us_ptr + row) * tl.where(use_residual, residual_mass, target_mass)
    acc = 0.0
    tok = row * 0 + V - 1
    found = row * 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        pt = tl.load(p_row + offs, mask=m, other=0.0)
        qt = tl.load(q_row + offs, mask=m & ((offs * 0 + use_residual.to(tl.int32)) > 0), other=0.0)
        w = tl.maximum(pt - qt, 0.0)
        hit = ((acc + tl.cumsum(w, 0)) >= threshold) & m
        first = tl.min(tl.where(hit, offs, V), 0)
        tok = tl.where((found == 0) & (first < V), first, tok)
        found = tl.where(first < V, 1, found)
        acc += tl.sum(w, 0)
    tl.store(n_ptr + row, n.to(tl.int64))
    tl.store(tok_ptr + row, tok.to(tl.int64))


def accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
           u_sample: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: same contract as accept_ref."""
    bsz, b = drafts.shape
    v = p.shape[-1]
    if p.shape != (bsz, b + 1, v) or q.shape != (bsz, b, v):
        raise ValueError(f"accept: p {tuple(p.shape)} / q {tuple(q.shape)} do not fit drafts {tuple(drafts.shape)}")
    if u_accept.shape != (bsz, b) or u_sample.shape != (bsz,):
        raise ValueError("accept: uniforms must be [B, b] and [B]")
    if not use_triton(p, impl):
        return accept_ref(p, q, drafts, u_accept, u_sample)
    p, q = p.float().contiguous(), q.float().contiguous()
    n = torch.empty(bsz, dtype=torch.int64, device=p.device)
    tok = torch.empty(bsz, dtype=torch.int64, device=p.device)
    with on_device(p):  # launch on the tensors' GPU
        _kernel[(bsz,)](p, q, drafts.contiguous(), u_accept.float().contiguous(), u_sample.float().contiguous(), n, tok,
                        V=v, BLOCK_V=min(1024, triton.next_power_of_2(v)), NB=b)
    return n, tok
