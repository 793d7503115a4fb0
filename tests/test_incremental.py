"""Incremental decode equals the full forward: prefill, chunked prefill, token steps, multi-token steps,
partially accepted steps and batches of requests at different lengths (tiny preset, fp32, simulations off)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.runner import CacheSizing, ModelRunner

from .conftest import random_ids, tiny_model

ATOL = 2e-4
SIZING = CacheSizing(max_requests=6, max_tokens=4096, block_size=4)  # small blocks: many pages per request


def test_tiny_sequence_crosses_every_boundary(tiny):
    cfg = tiny.cfg
    assert 300 > 2 * 128 and 300 > cfg.sliding_window and 300 // 4 > cfg.index_topk
    assert {"swa", "csa", "hca"} <= set(cfg.layer_kinds)


@pytest.mark.parametrize("prompt,steps", [(37, [1]), (1, [1, 3, 1, 6, 2, 5]), (130, [4, 1, 7])])
def test_prefill_then_steps_equal_full(tiny, prompt, steps):
    ids = random_ids(300, seed=prompt)
    full = tiny(ids)[0]
    run = ModelRunner(tiny, SIZING)
    rc = run.new_request()
    got = [run.prefill(rc, ids[0, :prompt].tolist())]
    pos, i = prompt, 0
    while pos < 300:
        k = min(steps[i % len(steps)], 300 - pos)
        got.append(run.step([(rc, ids[0, pos:pos + k].tolist())])[0])
        pos, i = pos + k, i + 1
    torch.testing.assert_close(torch.cat(got), full, atol=ATOL, rtol=0)


def test_chunked_prefill_equals_full(tiny):
    ids = random_ids(300, seed=7)
    full = tiny(ids)[0]
    run = ModelRunner(tiny, SIZING)
    for chunk in (17, 128, 64):
        rc = run.new_request()
        torch.testing.assert_close(run.prefill(rc, ids[0].tolist(), chunk=chunk), full, atol=ATOL, rtol=0)
        run.release(rc)


def test_rejected_tokens_leave_no_trace(tiny):
    """Steps of K tokens of which only a prefix is committed (the rest are wrong tokens) equal the full forward."""
    ids = random_ids(300, seed=3)
    full = tiny(ids)[0]
    run = ModelRunner(tiny, SIZING)
    rc = run.new_request()
    run.prefill(rc, ids[0, :20].tolist())
    rng = random.Random(0)
    pos = 20
    while pos < 299:
        k = rng.randint(1, 6)
        n = rng.randint(1, k)
        true = ids[0, pos:pos + n].tolist()
        if len(true) < n:
            break
        junk = [rng.randrange(6, 1024) for _ in range(k - n)]
        batch = run.batch([(rc, true + junk)])
        out = run.extend(batch)
        logits = tiny.logits(out.streams)[0, :n]
        run.commit([rc], batch, out, [n])
        torch.testing.assert_close(logits, full[pos:pos + n], atol=ATOL, rtol=0)
        pos += n


def test_batch_of_different_lengths_equals_each_alone(tiny):
    prompts = [5, 40, 131, 77]
    seqs = [random_ids(260, seed=100 + p)[0] for p in prompts]
    fulls = [tiny(s[None])[0] for s in seqs]
    run = ModelRunner(tiny, SIZING)
    rcs = [run.new_request() for _ in prompts]
    for rc, s, p, f in zip(rcs, seqs, prompts, fulls):
        torch.testing.assert_close(run.prefill(rc, s[:p].tolist(), chunk=64), f[:p], atol=ATOL, rtol=0)
    pos = list(prompts)
    for k in [1, 2, 1, 5, 1, 3] * 8:
        live = [i for i in range(len(rcs)) if pos[i] + k <= 260]
        if not live:
            break
        rows = [(rcs[i], seqs[i][pos[i]:pos[i] + k].tolist()) for i in live]
        logits = run.step(rows, pad_to=8)  # padded to a bucket: padding rows must not disturb real ones
        for j, i in enumerate(live):
            torch.testing.assert_close(logits[j], fulls[i][pos[i]:pos[i] + k], atol=ATOL, rtol=0)
            pos[i] += k


def test_reused_slot_starts_clean(tiny):
    ids = random_ids(60, seed=9)
    full = tiny(ids)[0]
    run = ModelRunner(tiny, CacheSizing(max_requests=1, max_tokens=512, block_size=4))
    rc = run.new_request()
    run.prefill(rc, random_ids(200, seed=10)[0].tolist())
    run.release(rc)
    rc = run.new_request()
    torch.testing.assert_close(run.prefill(rc, ids[0].tolist(), chunk=16), full, atol=ATOL, rtol=0)


def test_qat_simulation_changes_outputs_and_matches_on_short_prefix():
    """The reference's fp8/fp4 simulations are active by default and alter the logits."""
    ids = random_ids(64, seed=1)
    on, off = tiny_model(qat_sim=True), tiny_model(qat_sim=False)
    assert (on(ids) - off(ids)).abs().max() > 1e-3
