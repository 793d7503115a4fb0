"""Shared fixtures: tiny deterministic models and checkpoints generated on the fly (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    # lets the kernel tests run Triton kernels on the CPU; must precede the first import of `kernels`
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from model.presets import preset
from model.random_init import init_random_
from model.target import Transformer


def tiny_model(seed: int = 0, qat_sim: bool = False, **overrides) -> Transformer:
    cfg = dataclasses.replace(preset("tiny"), qat_sim=qat_sim, **overrides)
    m = Transformer(cfg)
    init_random_(m, seed, cfg.n_routed_experts)
    return m.eval()


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


def random_ids(n: int, seed: int, vocab: int = 1024, batch: int = 1) -> torch.Tensor:
    return torch.randint(6, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))
