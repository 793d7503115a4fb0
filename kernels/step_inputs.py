"""Preparing a padded verification batch on the device: [anchor, drafts] token rows and their positions, with
padding rows (index >= n_real) zeroed, so no draft token has to visit the host before the target runs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, use_triton


def verify_inputs_ref(anchor: torch.Tensor, drafts: torch.Tensor, start: torch.Tensor, n_real: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """anchor [B], drafts [B, b], start [B] int64 -> (input_ids [B, b+1], positions [B, b+1]); rows >= n_real: 0."""
    ids = torch.cat((anchor[:, None], drafts), 1)
    pos = start[:, None] + torch.arange(ids.shape[1], device=ids.device)
    real = (torch.arange(ids.shape[0], device=ids.device) < n_real)[:, None]
    return ids.where(real, 0), pos.where(real, 0)


@triton.jit
def _kernel(a_ptr, d_ptr, s_ptr, ids_ptr, pos_ptr, n_real, NB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    m = j < NB + 1
    real = row < n_real
    a = tl.load(a_ptr + row)
    d = tl.load(d_ptr + row * NB + j - 1, mask=m & (j > 0), other=0)
    tok = tl.where(j == 0, a, d)
    pos = tl.load(s_ptr + row) + j
    tl.store(ids_ptr + row * (NB + 1) + j, tl.where(real, tok, 0), mask=m)
    tl.store(pos_ptr + row * (NB + 1) + j, tl.where(real, pos, 0), mask=m)


def verify_inputs(anchor: torch.Tensor, drafts: torch.Tensor, start: torch.Tensor, n_real: int
                  , impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: same contract as verify_inputs_ref."""
    b, nb = drafts.shape
    if anchor.shape != (b,) or start.shape != (b,):
        raise ValueError(f"verify_inputs: anchor {tuple(anchor.shape)} / start {tuple(start.shape)} must be [{b}]")
    if not 0 <= n_real <= b:
        raise ValueError(f"verify_inputs: n_real {n_real} outside 0..{b}")
    if not use_triton(drafts, impl):
        return verify_inputs_ref(anchor, drafts, start, n_real)
    ids = torch.empty(b, nb + 1, dtype=torch.int64, device=drafts.device)
    pos = torch.empty_like(ids)
    with on_device(drafts):  # launch on the tensors' GPU
        _kernel[(b,)](anchor.long().contiguous(), drafts.long().contiguous(), start.long().contiguous(), ids, pos, n_real,
                      NB=nb, BLOCK=triton.next_power_of_2(nb + 1))
    return ids, pos
