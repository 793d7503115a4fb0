"""Triton kernels. Each module holds the `_kernel`, a launcher that checks shapes/dtypes, and a `*_ref` in PyTorch
that the tests compare against (on CPU under TRITON_INTERPRET=1). Launchers fall back to the reference where
Triton cannot run (a CPU tensor without the interpreter)."""

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
