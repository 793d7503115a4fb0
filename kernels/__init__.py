"""Triton kernels. Each module holds the `_kernel`, a launcher that checks shapes/dtypes, and a `*_ref` in PyTorch
that the tests compare against. Launchers take `impl`: "auto" runs Triton on CUDA tensors and the reference
elsewhere; "triton" forces the kernel (on the CPU this needs TRITON_INTERPRET=1 set before the kernels are
imported, as the test suite does)."""

import contextlib

import torch


def use_triton(t: torch.Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "ref"):
        raise ValueError(f"impl must be auto, triton or ref, got {impl!r}")
    return impl == "triton" or (impl == "auto" and t.is_cuda)


def on_device(t: torch.Tensor):
    """Launch context for a kernel on t's device (the current device may be another GPU; nothing on the CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
