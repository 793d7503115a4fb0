"""The DeepSeek-V4 MoE router: bias-corrected top-k (or hash-table ids), renormalised and scaled weights, and inert
padding rows (weight 0, expert id -1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, use_triton


def route_ref(scores: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None,
              is_padding: torch.Tensor, top_k: int, renorm: bool, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int64; 0 and -1 on padding rows).

    Hash layers take the ids from `hash_ids` [T, k]; others take the top-k of scores + bias (the bias only picks;
    among equal keys the lower expert id wins)."""
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        keys = scores + bias if bias is not None else scores
        ids = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(-1, ids)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    pad = is_padding[:, None]
    return weights.masked_fill(pad, 0.0), ids.masked_fill(pad, -1)


@triton.jit
def _kernel(s_ptr, b_ptr, h_ptr, pad_ptr, w_ptr, id_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
            HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, RENORM: tl.constexpr, scaling):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    s = tl.load(s_ptr + row * E + offs, mask=valid, other=0.0)
    key = s
    if HAS_BIAS:
        key = s + tl.load(b_ptr + offs, mask=valid, other=0.0)
    key = tl.where(valid, key, float("-inf"))
    kk = tl.arange(0, K)
    ids = tl.zeros([K], dtype=tl.int64)
    ws = tl.zeros([K], dtype=tl.float32)
    for j in tl.static_range(K):
        if HASHED:
            e = tl.load(h_ptr + row * K + j).to(tl.int32)
        else:
            best = tl.max(key, 0)
            e = tl.min(tl.where(key == best, offs, BLOCK_E), 0)  # lowest id among equal keys
            key = tl.where(offs == e, float("-inf"), key)
        w = tl.sum(tl.where(offs == e, s, 0.0), 0)
        ids = tl.where(kk == j, e.to(tl.int64), ids)
        ws = tl.where(kk == j, w, ws)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = ws * scaling
    pad = tl.load(pad_ptr + row) != 0
    ws = tl.where(pad, 0.0, ws)
    ids = tl.where(pad, -1, ids)
    tl.store(w_ptr + row * K + kk, ws)
    tl.store(id_ptr + row * K + kk, ids)


def route(scores: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, is_padding: torch.Tensor,
          top_k: int, renorm: bool, scaling: float, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: same contract as route_ref."""
    t, e = scores.shape
    if is_padding.shape != (t,):
        raise ValueError(f"route: is_padding {tuple(is_padding.shape)} does not match {t} rows")
    if hash_ids is not None and hash_ids.shape != (t, top_k):
        raise ValueError(f"route: hash ids {tuple(hash_ids.shape)} must be [{t}, {top_k}]")
    if top_k > e:
        raise ValueError(f"route: top_k {top_k} exceeds {e} experts")
    if not use_triton(scores, impl) or top_k & (top_k - 1):
        return route_ref(scores, bias, hash_ids, is_padding, top_k, renorm, scaling)
    scores = scores.float().contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=scores.device)
    dummy = scores.new_zeros(1)
    with on_device(scores):  # launch on the tensors' GPU
        _kernel[(t,)](scores, bias.float().contiguous() if bias is not None else dummy,
                      hash_ids.contiguous() if hash_ids is not None else dummy, is_padding.to(torch.int8).contiguous(),
                      w, ids, E=e, K=top_k, BLOCK_E=triton.next_power_of_2(e), HAS_BIAS=bias is not None,
                      HASHED=hash_ids is not None, RENORM=renorm, scaling=float(scaling))
    return w, ids
