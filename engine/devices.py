"""Choosing the torch device and dtype from the services' `--device` / `--dtype` settings."""

from __future__ import annotations


def resolve_device(device: str, dtype: str):
    """"auto": the GPU when there is one; dtype "auto": bf16 on GPU, fp32 on CPU. Returns (torch.device, dtype)."""
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, dtype)
