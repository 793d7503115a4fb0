"""Triton kernels against their PyTorch references, run under TRITON_INTERPRET=1 on the CPU.

Data movement and index selection must match exactly; float outputs within the dtype tolerance table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5)}


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("t,e,k,hashed,renorm", [(5, 123, 4, False, True), (7, 8, 2, True, True),
                                                 (3, 256, 8, False, False), (1, 16, 1, False, True)])
def test_router_matches_reference(t, e, k, hashed, renorm):
    from kernels.router import route, route_ref
    scores = torch.rand(t, e, generator=_g(t + e))
    bias = None if hashed else torch.randn(e, generator=_g(1)) * 0.1
    hash_ids = torch.rand(t, e, generator=_g(2)).argsort(-1)[:, :k] if hashed else None
    pad = torch.zeros(t, dtype=torch.bool)
    pad[-1] = t > 1
    w, ids = route(scores, bias, hash_ids, pad, k, renorm, 1.5, impl="triton")
    wr, idr = route_ref(scores, bias, hash_ids, pad, k, renorm, 1.5)
    assert torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, **TOL[torch.float32])
    if t > 1:
        assert (ids[-1] == -1).all() and (w[-1] == 0).all()


def test_router_ties_pick_lowest_expert():
    from kernels.router import route, route_ref
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9, 0.2, 0.0, 0.3]])
    pad = torch.zeros(1, dtype=torch.bool)
    assert route(scores, None, None, pad, 2, True, 1.0, impl="triton")[1].tolist() == [[1, 2]]
    assert route_ref(scores, None, None, pad, 2, True, 1.0)[1].tolist() == [[1, 2]]


@pytest.mark.parametrize("b,nb,n_real", [(8, 4, 5), (1, 1, 1), (4, 5, 0), (16, 7, 16)])
def test_verify_inputs_match_reference_exactly(b, nb, n_real):
    from kernels.step_inputs import verify_inputs, verify_inputs_ref
    anchor = torch.randint(0, 1000, (b,), generator=_g(b))
    drafts = torch.randint(0, 1000, (b, nb), generator=_g(nb))
    start = torch.randint(0, 500, (b,), generator=_g(3))
    got = verify_inputs(anchor, drafts, start, n_real, impl="triton")
    want = verify_inputs_ref(anchor, drafts, start, n_real)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0][n_real:] == 0).all() and (got[0][:n_real, 0] == anchor[:n_real]).all()


def _dist(bsz, b, v, seed, onehot=False):
    x = torch.rand(bsz, b, v, generator=_g(seed)) ** 3
    if onehot:
        x = torch.nn.functional.one_hot(x.argmax(-1), v).float()
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("bsz,b,v,onehot", [(6, 4, 37, False), (3, 5, 1100, False), (5, 3, 50, True)])
def test_acceptance_matches_reference_exactly(bsz, b, v, onehot):
    from kernels.acceptance import accept, accept_ref
    p, q = _dist(bsz, b + 1, v, 1, onehot), _dist(bsz, b, v, 2, onehot)
    drafts = torch.stack([torch.multinomial(q[i], 1, generator=_g(i)).squeeze(-1) for i in range(bsz)])
    drafts[0] = p[0, :b].argmax(-1)  # a row that accepts more
    ua, us = torch.rand(bsz, b, generator=_g(5)), torch.rand(bsz, generator=_g(6))
    n, tok = accept(p, q, drafts, ua, us, impl="triton")
    nr, tokr = accept_ref(p, q, drafts, ua, us)
    assert torch.equal(n, nr) and torch.equal(tok, tokr)


def test_kernels_really_run_under_the_interpreter():
    """impl="triton" really takes the kernel path (the reference is not consulted)."""
    code = ("import torch, kernels.router as r\n"
            "r.route_ref = None\n"
            "w, i = r.route(torch.rand(2, 8), None, None, torch.zeros(2, dtype=torch.bool), 2, True, 1.0, "
            "impl='triton')\n"
            "print(i.shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert out.returncode == 0 and "torch.Size([2, 2])" in out.stdout, out.stderr


@pytest.mark.parametrize("shape,iters", [((5, 123, 4, 4), 20), ((1, 4, 4), 1), ((37, 8, 8), 7)])
def test_sinkhorn_matches_reference(shape, iters):
    from kernels.sinkhorn import sinkhorn, sinkhorn_ref
    x = torch.randn(shape, generator=_g(len(shape))) * 3
    got = sinkhorn(x, iters, 1e-6, impl="triton")
    torch.testing.assert_close(got, sinkhorn_ref(x, iters, 1e-6), **TOL[torch.float32])
    torch.testing.assert_close(got.sum(-2), torch.ones(shape[:-2] + shape[-1:]), atol=1e-5, rtol=0)
