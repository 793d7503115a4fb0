"""Building blocks shared by the target and the drafter: norms, rotary embeddings, hyper-connections.

Everything here is position-wise or parameter-only; nothing holds per-request state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.sinkhorn import sinkhorn

from .config import ModelConfig, YarnConfig


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight; computes in fp32 and casts back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x.float(), self.eps) * self.weight).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim (in x's dtype; callers pass fp32 where it matters)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


# ---- rotary embeddings ---------------------------------------------------------------------------

def rope_inv_freq(dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] fp32 for interleaved rope; YaRN-blended when `yarn` is given."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None or yarn.original_max_position_embeddings <= 0 or yarn.factor <= 1.0:
        return inv
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / yarn.factor * ramp + inv * (1 - ramp)


class Rope(nn.Module):
    """Interleaved (GPT-J style) rotary embedding on the last `dim` channels of a vector."""

    def __init__(self, dim: int, theta: float, yarn: YarnConfig | None):
        super().__init__()
        self.dim, self.theta, self.yarn = dim, theta, yarn
        self.register_buffer("inv_freq", self.computed_inv_freq(), persistent=False)

    def computed_inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.dim, self.theta, self.yarn)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int64 -> cos, sin [..., dim/2] fp32."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x [..., d] by cos/sin broadcast over x's leading dims.

    cos/sin [..., r/2] must broadcast against x[..., :r/2] after the caller inserts head dims.
    """
    r = cos.shape[-1] * 2
    nope, rot = x[..., :-r], x[..., -r:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    if inverse:
        sin = -sin
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)


# ---- manifold-constrained hyper-connections ----------------------------------------------------

class HyperConnection(nn.Module):
    """Mixes hc_mult residual streams around one sublayer (mHC).

    `pre` collapses the streams into the sublayer input, `post` spreads the sublayer output back, and `comb`
    (made doubly stochastic by Sinkhorn iterations) mixes the incoming streams into the outgoing ones.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., n, H] -> pre [..., n], post [..., n], comb [..., n, n] (all fp32)."""
        n = self.n
        flat = rms_normalize(streams.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        logits = comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n)
        return pre, post, sinkhorn(logits, self.iters, self.hc_eps)  # kernels.sinkhorn (reference on the CPU)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., n, H] -> (sublayer input [..., H], post, comb)."""
        pre, post, comb = self.weights(streams)
        x = (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)
        return x, post, comb

    @staticmethod
    def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams [..., n, H]: post_i * out + sum_j comb[j, i] * streams_j."""
        mixed = torch.matmul(comb.transpose(-1, -2), streams.float())
        return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(streams.dtype)


class HyperHead(nn.Module):
    """Final collapse of the hc_mult streams into one hidden state before the last norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_normalize(streams.flatten(-2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn) * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)
