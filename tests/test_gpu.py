"""GPU-only checks (skipped without CUDA): the CUDA path equals the CPU path, CUDA-graph decode steps equal eager
ones, and speculative decoding stays lossless on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.proposer import DSparkProposer
from engine.runner import CacheSizing
from engine.sampling import SamplingParams
from model.drafter import Drafter
from model.random_init import init_random_

from .conftest import random_ids, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SIZING = CacheSizing(max_requests=4, max_tokens=4096, block_size=16)


def _models(device, qat_sim=False):
    target = tiny_model(qat_sim=qat_sim).to(device)
    drafter = Drafter(target.cfg)
    init_random_(drafter, 7, target.cfg.n_routed_experts)
    return target, drafter.to(device)


def _run(engine, prompts, n=30):
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]


def test_cuda_forward_matches_cpu():
    ids = random_ids(300, seed=2, batch=2)
    cpu = tiny_model()(ids)
    gpu = tiny_model().cuda()(ids.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=0)


def test_graphed_steps_equal_eager_and_stay_lossless():
    target, drafter = _models("cuda")
    prompts = [random_ids(n, seed=n)[0].tolist() for n in (5, 40, 150, 17, 64)]
    plain = _run(Engine(target, sizing=SIZING), prompts)
    eager = _run(Engine(target, sizing=SIZING, proposer=DSparkProposer(drafter, target)), prompts)
    graphed_engine = Engine(target, sizing=SIZING, proposer=DSparkProposer(drafter, target), cuda_graphs=True,
                            max_model_len=512)
    assert graphed_engine.graphs is not None and graphed_engine.graphs.has(4)
    graphed = _run(graphed_engine, prompts)
    plain_graphed = _run(Engine(target, sizing=SIZING, cuda_graphs=True, max_model_len=512), prompts)
    assert eager == plain and graphed == plain and plain_graphed == plain


@pytest.mark.parametrize("qat_sim", [False, True])
def test_graph_verify_logits_equal_eager(qat_sim):
    """With the fp8/fp4 simulations on, capture must also work (no host copies inside the step); a rounding
    boundary crossed in the last bit can move a logit further, hence the looser bound there."""
    target, drafter = _models("cuda", qat_sim)
    eng = Engine(target, sizing=SIZING, proposer=DSparkProposer(drafter, target), cuda_graphs=True,
                 max_model_len=512)
    runner = eng.runner
    rcs = [runner.new_request() for _ in range(3)]
    for rc, n in zip(rcs, (20, 77, 130)):
        runner.prefill(rc, random_ids(n, seed=n)[0].tolist())
    rows = [(rc, random_ids(5, seed=i)[0].tolist()) for i, rc in enumerate(rcs)]
    batch = runner.batch(rows, pad_to=4)
    _, logits_g = eng.graphs.verify(batch)
    logits_g = logits_g.clone()
    out_e = runner.extend(batch, capture=eng.proposer.capture)
    logits_e = target.logits(out_e.streams)
    torch.testing.assert_close(logits_g[:3], logits_e[:3], atol=5e-2 if qat_sim else 1e-4, rtol=0)


def test_graphs_per_context_level_equal_eager():
    """Requests of 20..940 tokens in one batch and alone: each step replays the verification graph of its
    longest request's context level (512 or 1024 here), and outputs equal the eager engine's."""
    target, drafter = _models("cuda")
    prompts = [random_ids(n, seed=n)[0].tolist() for n in (20, 300, 900)]
    sizing = CacheSizing(max_requests=4, max_tokens=8192, block_size=16)
    plain = _run(Engine(target, sizing=sizing), prompts, n=40)
    graphed_engine = Engine(target, sizing=sizing, proposer=DSparkProposer(drafter, target), cuda_graphs=True,
                            max_model_len=1024)
    assert graphed_engine.graphs.levels[:2] == (512, 1024)
    assert _run(graphed_engine, prompts, n=40) == plain
    assert [_run(graphed_engine, [p], n=40)[0] for p in prompts] == plain


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_graphed_engine_on_a_second_gpu():
    """The model on cuda:1 while the calling thread's current device is cuda:0 (the decode service's case with
    --device cuda:1), after the tests above captured graphs on cuda:0 in this process: capture and replay must
    happen on the model's device, on a capture stream of that device."""
    assert torch.cuda.current_device() == 0
    target, drafter = _models("cuda:1")
    prompts = [random_ids(n, seed=n)[0].tolist() for n in (5, 40, 150)]
    plain = _run(Engine(target, sizing=SIZING), prompts)
    graphed = _run(Engine(target, sizing=SIZING, proposer=DSparkProposer(drafter, target), cuda_graphs=True,
                          max_model_len=512), prompts)
    assert graphed == plain
