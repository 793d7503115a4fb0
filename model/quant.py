"""The published DeepSeek-V4 weight formats, quantised at checkpoint generation and dequantised at load.

- fp8: e4m3 weights with one power-of-two (ue8m0) scale per 128x128 block, stored as `<name>.scale` [ceil(out/128),
  ceil(in/128)] float8_e8m0fnu.
- fp4: routed experts in e2m1, two values per byte (element 2i in the low nibble) stored as int8, with one
  power-of-two scale per 32 input elements, stored as `<name>.scale` [out, in/32] float8_e8m0fnu.
Loading also accepts fp32 scales.
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP4_BLOCK = 32


_FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4_VALUES and the rounding midpoints on `device`, copied once: a decode step captured as a CUDA graph may
    not copy from the host (the first eager call, before capture, fills this cache)."""
    return FP4_VALUES.to(device), _FP4_MIDPOINTS.to(device)


def _pow2_scale(amax: torch.Tensor, qmax: float, floor: float = 1e-30) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (ue8m0 scales)."""
    amax = amax.float().clamp(min=floor)
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round x (already scaled into [-6, 6]) to e2m1 codes, ties to even: [...] int64 in 0..15."""
    mids = _constants(x.device)[1]
    a = x.abs().clamp(max=6.0)
    code = torch.bucketize(a, mids)
    tie = (a == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    return code + tie.long() + 8 * (x < 0).long()


def _blockwise(x: torch.Tensor, block: int, fn) -> torch.Tensor:
    """Apply fn to blocks of `block` elements along the last dim (a partial last block is zero-padded)."""
    d = x.shape[-1]
    pad = -d % block
    xp = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    y = fn(xp.unflatten(-1, (-1, block))).flatten(-2)
    return y[..., :d].to(x.dtype)


def fp8_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Quantise to e4m3 with one power-of-two scale per block and back (the reference's KV QAT simulation)."""
    def q(t):
        s = _pow2_scale(t.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
        return (t / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return _blockwise(x, block, q)


def fp4_roundtrip(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Quantise to e2m1 with one power-of-two scale per block and back (the indexer's QAT simulation)."""
    def q(t):
        s = _pow2_scale(t.abs().amax(-1, keepdim=True), 6.0, 6 * 2.0 ** -126)
        return _constants(t.device)[0][fp4_codes(t / s)] * s
    return _blockwise(x, block, q)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two dim, got {d}")
    y = x.float()
    h = 1
    while h < d:
        y = y.unflatten(-1, (-1, 2, h))
        y = torch.cat((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), -1).flatten(-2)
        h *= 2
    return (y * d ** -0.5).to(x.dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], scale [ceil(out/bo), ceil(in/bi)] fp32)."""
    bo, bi = block
    out_dim, in_dim = w.shape
    po, pi = -out_dim % bo, -in_dim % bi
    padded = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = _pow2_scale(tiles.abs().amax(dim=(1, 3)), FP8_MAX)
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bo, bi = block
    out_dim, in_dim = q.shape
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8 scale has shape {tuple(scale.shape)}, expected {expected} for weight {tuple(q.shape)}")
    full = scale.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    return q.float() * full


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in divisible by 32) -> (packed uint8 [out, in/2], scale [out, in/32] fp32)."""
    out_dim, in_dim = w.shape
    if in_dim % FP4_BLOCK:
        raise ValueError(f"fp4 needs the input dim to be a multiple of {FP4_BLOCK}, got {in_dim}")
    groups = w.float().view(out_dim, in_dim // FP4_BLOCK, FP4_BLOCK)
    scale = _pow2_scale(groups.abs().amax(-1), 6.0)
    codes = fp4_codes((groups / scale[..., None]).view(out_dim, in_dim)).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dim, half = packed.shape
    if tuple(scale.shape) != (out_dim, 2 * half // FP4_BLOCK):
        raise ValueError(f"fp4 scale has shape {tuple(scale.shape)}, expected {(out_dim, 2 * half // FP4_BLOCK)}")
    p = packed.view(torch.uint8).long()
    codes = torch.stack((p & 0xF, p >> 4), -1).view(out_dim, 2 * half)
    values = _constants(packed.device)[0][codes]
    return (values.view(out_dim, -1, FP4_BLOCK) * scale.float()[..., None]).view(out_dim, 2 * half)
