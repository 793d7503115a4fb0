"""Deterministic random weights for generated checkpoints.

Scales keep activations of order one through every layer, so that tests comparing two execution paths are
sensitive to any difference (tiny weights would make every path agree trivially).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    # one stream per tensor name: a tensor's values do not depend on which other tensors exist
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_random_(model: nn.Module, seed: int, n_experts: int) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        g = _generator(seed, name)
        with torch.no_grad():
            t.copy_(_sample(name, t.shape, g, n_experts).to(t.dtype))


def _sample(name: str, shape: torch.Size, g: torch.Generator, n_experts: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct experts per token
        return torch.rand(shape[0], n_experts, generator=g).argsort(-1)[:, : shape[1]]
    if "norm" in name:  # RMSNorm weights
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if leaf == "attn_sink":
        return torch.randn(shape, generator=g)
    if leaf == "ape":
        return 0.5 * torch.randn(shape, generator=g)
    if leaf == "bias":  # router correction bias
        return 0.1 * torch.randn(shape, generator=g)
    if leaf == "base":
        return 0.5 * torch.randn(shape, generator=g)
    if leaf == "scale":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if leaf == "fn":
        return torch.randn(shape, generator=g) * 0.5 / shape[-1] ** 0.5
    if name.endswith("embed.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5  # linear weights [.., out, in]

