"""Config parsing and the V4-Flash parameter count on the meta device."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import config_from_dict, load_config
from model.presets import FLASH, preset
from model.target import Transformer


def flash_params_by_hand() -> int:
    v, h, n_layers, nh, d, ql, og, olr = 129280, 4096, 43, 64, 512, 1024, 8, 1024
    e, inter, hc, di, nih = 256, 2048, 4, 128, 64
    ratios = [0, 0] + [4, 128] * 20 + [4]
    total = 2 * v * h + h + (hc * hc * h + hc + 1)  # embed, head, norm, hc_head
    for i, r in enumerate(ratios):
        layer = 2 * h + 2 * ((2 + hc) * hc * hc * h + (2 + hc) * hc + 3)  # norms, two mHC
        layer += h * ql + ql + ql * nh * d + h * d + d + (nh * d // og) * (og * olr) + og * olr * h + nh
        if r == 4:
            layer += 2 * h * 2 * d + 4 * 2 * d + d  # overlapping compressor
            layer += ql * nih * di + h * nih + 2 * h * 2 * di + 4 * 2 * di + di  # indexer
        elif r == 128:
            layer += 2 * h * d + 128 * d + d
        layer += e * h + (0 if i < 3 else e) + e * 3 * h * inter + 3 * h * inter  # gate (+bias), experts, shared
        total += layer
    return total


def test_flash_instantiates_on_meta_with_284b_parameters():
    cfg = preset("flash")
    assert cfg.layer_kinds.count("csa") == 21 and cfg.layer_kinds.count("hca") == 20
    with torch.device("meta"):
        m = Transformer(cfg)
    count = sum(p.numel() for p in m.parameters())
    assert count == flash_params_by_hand()
    assert abs(count - 284.3e9) < 0.1e9  # transformers reports 284.3B for the same config


def test_flash_config_keys_parse(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**FLASH, "expert_dtype": "fp4"}))
    cfg = load_config(tmp_path)
    assert cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.quant.weight_fmt == "fp8" and cfg.quant.expert_fmt == "fp4" and cfg.quant.block == (128, 128)
    assert cfg.kind(0) == "swa" and cfg.kind(2) == "csa" and cfg.kind(3) == "hca" and cfg.kind(42) == "csa"
    assert cfg.is_hash_layer(2) and not cfg.is_hash_layer(3)


def test_tiny_has_dspark_fields():
    cfg = preset("tiny")
    assert cfg.has_dspark and cfg.dspark_block_size > 1 and len(cfg.dspark_target_layer_ids) == 3


@pytest.mark.parametrize("bad,msg", [
    ({"compress_ratios": [0, 3, 4, 128, 0, 0]}, "0, 4 or 128"),
    ({"compress_ratios": [0, 4]}, "num_hidden_layers"),
    ({"o_groups": 3}, "o_groups"),
    ({"scoring_func": "relu"}, "scoring_func"),
])
def test_bad_config_values_are_named(bad, msg):
    from model.presets import TINY
    with pytest.raises(ValueError, match=msg):
        config_from_dict({**TINY, **bad})


def test_missing_required_key():
    with pytest.raises(ValueError, match="hidden_size"):
        config_from_dict({"vocab_size": 10})
