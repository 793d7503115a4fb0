"""DeepSeek-V4 target and DSpark drafter: config, layers, checkpoints, tokenizer.

Entry point: `model.load(checkpoint_dir, device=..., dtype=...)` returns the target; its
`forward(input_ids [batch, seq] int64)` returns logits [batch, seq, vocab] from a full forward.
"""

from .checkpoint import load
from .config import ModelConfig, load_config

__all__ = ["load", "load_config", "ModelConfig"]
