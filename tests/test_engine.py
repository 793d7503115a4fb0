"""The aggregated engine: greedy output equals decoding by repeated full forwards; continuous batching does not
change results; sampling is reproducible per seed; stop rules."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.runner import CacheSizing
from engine.sampling import SamplingParams, probs_from_logits, sample_from_probs, uniform
from model.tokenizer import Tokenizer

from .conftest import random_ids

SIZING = CacheSizing(max_requests=4, max_tokens=2048, block_size=8)


def greedy_by_full_forward(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def run_all(engine: Engine, reqs) -> dict[str, list[int]]:
    while engine.has_work():
        engine.step()
    return {r.request_id: r.output_ids for r in reqs}


def test_greedy_equals_full_forward_with_requests_joining_and_leaving(tiny):
    prompts = [random_ids(n, seed=n)[0].tolist() for n in (3, 30, 150, 17, 64, 9)]
    lengths = [40, 12, 25, 33, 5, 20]
    eng = Engine(tiny, sizing=SIZING)  # 4 slots for 6 requests: later ones join as others finish
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    outs = run_all(eng, reqs)
    for r, p, n in zip(reqs, prompts, lengths):
        assert outs[r.request_id] == greedy_by_full_forward(tiny, p, n), r.request_id
        assert r.finish_reason == "length"
    assert eng.runner.alloc.free_slot_count == SIZING.max_requests  # everything released


def test_sampling_is_reproducible_and_independent_of_batch(tiny):
    p = random_ids(20, seed=1)[0].tolist()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=42, ignore_eos=True)
    alone = Engine(tiny, sizing=SIZING)
    a = alone.add_request(p, params)
    run_all(alone, [a])
    crowd = Engine(tiny, sizing=SIZING)
    others = [crowd.add_request(random_ids(30, seed=s)[0].tolist(), SamplingParams(temperature=1.0, seed=s,
                                                                                      max_tokens=15)) for s in (2, 3)]
    b = crowd.add_request(p, params)
    run_all(crowd, others + [b])
    assert a.output_ids == b.output_ids
    c = alone.add_request(p, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=43, ignore_eos=True))
    run_all(alone, [c])
    assert c.output_ids != a.output_ids


def test_sampler_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).repeat(20000, 1)
    ids = sample_from_probs(probs, torch.full((20000,), 7), torch.arange(20000), 0)
    freq = torch.bincount(ids, minlength=4).float() / 20000
    assert (freq - probs[0]).abs().max() < 0.015
    u = uniform(torch.tensor([1, 1]), torch.tensor([5, 5]), 0, 4)
    assert torch.equal(u[0], u[1]) and not torch.equal(uniform(torch.tensor([1]), torch.tensor([5]), 1, 4)[0], u[0])


def test_top_p_and_greedy_probs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, torch.tensor([1.0, 0.0]), torch.tensor([0.7, 1.0]))
    torch.testing.assert_close(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(p[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # the host-known all-greedy shortcut gives the general path's one-hot rows exactly
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    zeros, ones = torch.zeros(6), torch.ones(6)
    assert torch.equal(probs_from_logits(logits, zeros, ones, all_greedy=True), probs_from_logits(logits, zeros, ones))


def test_stop_string_and_eos(tiny):
    tok = Tokenizer("model/data/tiny")
    p = random_ids(12, seed=4)[0].tolist()
    eng = Engine(tiny, tok, sizing=SIZING)
    free = eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    run_all(eng, [free])
    text = tok.decode(free.output_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    cut = eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    run_all(eng, [cut])
    assert cut.finish_reason == "stop" and stop in tok.decode(cut.output_ids)
    assert len(cut.output_ids) < len(free.output_ids)


@pytest.mark.parametrize("prompt,params,msg", [
    ([], SamplingParams(), "empty"),
    ([5] * 10, SamplingParams(max_tokens=5000), "exceeds the context"),
    ([5, 99999], SamplingParams(), "outside the vocabulary"),
])
def test_bad_requests_are_refused(tiny, prompt, params, msg):
    with pytest.raises(ValueError, match=msg):
        Engine(tiny, sizing=SIZING).add_request(prompt, params)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_token_bytes_reassemble_the_text():
    tok = Tokenizer("model/data/tiny")
    text = "Héllo wörld — 日本 ok\n\tend"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()

    def partial(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True
    assert any(partial(tok.token_bytes(i)) for i in ids)  # some tokens hold part of a character


def test_vanishing_temperature_and_top_p_stay_well_defined():
    """temperature 1e-40 overflowed logits / t and top_p 1e-300 (0 in fp32) kept no token: both gave NaN rows."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    greedy = probs_from_logits(logits, torch.zeros(3), torch.ones(3))
    assert torch.equal(probs_from_logits(logits, torch.full((3,), 1e-40), torch.ones(3)), greedy)
    assert torch.equal(probs_from_logits(logits, torch.ones(3), torch.full((3,), 1e-300)), greedy)
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=0.01).greedy
