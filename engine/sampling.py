"""Sampling with counter-based randomness: every random number is a pure function of (request seed, position,
stream), so the draws do not depend on batch composition or on which other requests ran, and the drafter's and the
verifier's draws come from disjoint streams. (The logits can: a different batch shape can change their last bits,
which at high temperature may pick another token; at temperature 0 only an exact tie could.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# stream ids: disjoint counter ranges for each consumer of randomness
TARGET, DRAFT, ACCEPT = 0, 1, 2
# temperatures below this are greedy: logits / t would overflow fp32 (1e-40 gave NaN probabilities)
GREEDY_BELOW = 1e-5
_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives to report per token (None: none)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _as_int64(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic; logical shifts emulated)."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _MIX1
    x = (x ^ _lsr(x, 27)) * _MIX2
    return x ^ _lsr(x, 31)


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """seed, counter [B] int64 -> [B, n] fp32 uniforms in (0, 1), a pure function of the inputs."""
    lane = torch.arange(n, device=seed.device, dtype=torch.int64)
    key = _splitmix(_splitmix(seed * 4 + stream)[:, None] ^ (counter[:, None] * 1_000_003 + lane))
    bits = _lsr(_splitmix(key), 40).to(torch.float32)  # 24 random bits
    return (bits + 0.5) / float(1 << 24)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                      all_greedy: bool = False) -> torch.Tensor:
    """logits [B, V] fp32, temperature/top_p [B] -> probabilities [B, V] (rows with temperature 0: one-hot).

    all_greedy: the caller knows every row has temperature 0 (the host holds the parameters), so the softmax and
    the top-p sort over the vocabulary are skipped; the result is the same one-hot rows."""
    if all_greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = temperature < GREEDY_BELOW
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    keep_sorted[:, 0] = True  # the most likely token always stays (a top_p too small for fp32 kept none)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def sample_from_probs(probs: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Inverse-CDF sampling with counter-based uniforms: probs [B, V] -> ids [B] int64."""
    u = uniform(seed, counter, stream, 1)
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)
