"""`dspark-pd make-checkpoint`: a deterministic random checkpoint with tokenizer and chat template."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MakeCheckpointConfig:
    out: str = field(metadata={"help": "output directory"})
    preset: str = field(default="tiny", metadata={"help": "model size", "choices": ["tiny", "small"]})
    layout: str = field(default="official", metadata={"help": "tensor key layout",
                                                       "choices": ["official", "transformers"]})
    dtype: str = field(default="bf16", metadata={"help": "storage precision (fp8: fp8 block-scaled weights and "
                                                         "fp4 routed experts, as published)",
                                                 "choices": ["bf16", "fp32", "fp8"]})
    seed: int = field(default=0, metadata={"help": "random seed"})


def run(cfg: MakeCheckpointConfig) -> int:
    from model.synthetic import make_checkpoint

    out = make_checkpoint(cfg.preset, cfg.out, layout=cfg.layout, fmt=cfg.dtype, seed=cfg.seed)
    print(out)
    return 0
