"""Deterministic random checkpoints (`dspark-pd make-checkpoint`): a preset config, random weights, the
bundled-corpus BPE tokenizer and a chat template, written in either key layout and precision."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path


from . import keys
from .checkpoint import to_layout, write_shards
from .config import config_from_dict
from .drafter import Drafter
from .presets import PRESETS
from .random_init import init_random_
from .target import Transformer
from .tokenizer import write_tokenizer

log = logging.getLogger(__name__)
FORMATS = ("fp32", "bf16", "fp8")


def make_checkpoint(preset: str, out_dir: str | Path, layout: str = keys.OFFICIAL, fmt: str = "bf16",
                    seed: int = 0) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    raw = dict(PRESETS[preset])
    if fmt == "fp8":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        raw["expert_dtype"] = "fp4"
    else:
        raw.pop("quantization_config", None)
    cfg = config_from_dict(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = Transformer(cfg)
    init_random_(model, seed, cfg.n_routed_experts)
    sd = dict(model.state_dict())
    if cfg.has_dspark:
        drafter = Drafter(cfg)
        init_random_(drafter, seed, cfg.n_routed_experts)
        sd.update(drafter.state_dict())
    n_params = sum(v.numel() for k, v in sd.items() if not k.endswith(("inv_freq", "tid2eid")))
    log.info("initialised %s (%.1fM parameters) in %.1fs", preset, n_params / 1e6, time.time() - t0)
    tensors = to_layout(sd, cfg, layout, fmt)
    del model, sd
    write_shards(tensors, out)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    write_tokenizer(out, vocab_size=min(cfg.vocab_size, 1000))
    log.info("wrote %s (%s layout, %s) in %.1fs", out, layout, fmt, time.time() - t0)
    return out
