"""Full-forward parity with transformers' DeepseekV4ForCausalLM on identical tiny weights.

transformers lacks the reference's fp8/fp4 activation simulations (model/NOTES.md), so our side runs with them
off; everything else (SWA/CSA/HCA, indexer top-k, sinks, mHC, MoE, rope regimes) is compared."""

from __future__ import annotations

import pytest
import torch

import model
from model.synthetic import make_checkpoint

from .conftest import random_ids

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("layout", ["transformers", "official"])
def test_full_forward_matches_transformers(tmp_path, layout):
    make_checkpoint("tiny", tmp_path, layout=layout, fmt="fp32", seed=5)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = model.load(tmp_path, dtype=torch.float32, qat_sim=False)
    ids = random_ids(300, seed=11, vocab=1000, batch=2)  # crosses the window, 75 CSA and 2 HCA windows
    with torch.no_grad():
        want = hf(ids).logits
    got = ours(ids)
    assert got.abs().max() > 0.5  # a model that computes something
    torch.testing.assert_close(got, want, atol=5e-5, rtol=0)


def test_parity_is_sensitive_to_a_changed_weight(tmp_path):
    """The comparison above can fail: one perturbed sink changes the logits well beyond its tolerance."""
    make_checkpoint("tiny", tmp_path, layout="transformers", fmt="fp32", seed=5)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = model.load(tmp_path, dtype=torch.float32, qat_sim=False)
    ours.layers["2"].attn.attn_sink.add_(0.5)
    ids = random_ids(200, seed=12, vocab=1000)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() > 1e-2
