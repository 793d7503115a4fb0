"""The mHC combination matrix: a row softmax made doubly stochastic by Sinkhorn iterations, for many n x n
matrices at once. On the GPU one launch replaces the ~2 x iters small kernels per hyper-connection of the eager
version (a V4 decode step has two hyper-connections per layer)."""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from . import on_device, use_triton

log = logging.getLogger(__name__)


def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [..., n, n] fp32 -> row softmax + eps, then a column normalisation and (iters - 1) x (row, column)."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


@triton.jit
def _kernel(x_ptr, y_ptr, rows, iters, eps, N: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    i = tl.arange(0, N)[None, :, None]
    j = tl.arange(0, N)[None, None, :]
    offs = t * N * N + i * N + j
    mask = (t < rows) & (i < N) & (j < N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = x - tl.max(x, axis=2)[:, :, None]
    e = tl.exp(x)
    m = e / tl.sum(e, axis=2)[:, :, None] + eps
    m = m / (tl.sum(m, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        m = m / (tl.sum(m, axis=2)[:, :, None] + eps)
        m = m / (tl.sum(m, axis=1)[:, None, :] + eps)
    tl.store(y_ptr + offs, m, mask=mask)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, impl: str = "auto") -> torch.Tensor:
    """Launcher: same contract as sinkhorn_ref (n must be a power of two for the kernel)."""
    n = logits.shape[-1]
    if logits.shape[-2] != n or iters < 1:
        raise ValueError(f"sinkhorn: needs [..., n, n] matrices and iters >= 1, got {tuple(logits.shape)}, {iters}")
    if not use_triton(logits, impl) or n & (n - 1):
        return sinkhorn_ref(logits, iters, eps)
    if impl == "auto" and logits.is_cuda and not _checked_on(str(logits.device), n):
        return sinkhorn_ref(logits, iters, eps)
    return _launch(logits, iters, eps)


@functools.cache
def _checked_on(device: str, n: int) -> bool:
    """Run the kernel once against the reference on this device before trusting it in the model's hot path (a
    warning, not a crash, if it fails to build or disagrees: the reference is only slower)."""
    x = torch.randn(3, 5, n, n, generator=torch.Generator().manual_seed(0)).to(device)
    try:
        ok = torch.allclose(_launch(x, 20, 1e-6), sinkhorn_ref(x, 20, 1e-6), atol=1e-5, rtol=1e-4)
    except Exception as e:  # noqa: BLE001 - reported, and the reference is used
        log.warning("Triton sinkhorn kernel unavailable on %s (%s); using the PyTorch reference", device, e)
        return False
    if not ok:
        log.warning("Triton sinkhorn kernel disagrees with the reference on %s; using the reference", device)
    return ok


def _launch(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = logits.shape[-1]
    x = logits.float().contiguous()
    rows = x.numel() // (n * n)
    y = torch.empty_like(x)
    block = 16
    with on_device(x):
        _kernel[(triton.cdiv(rows, block),)](x, y, rows, iters, float(eps), N=n, BLOCK_T=block)
    return y
