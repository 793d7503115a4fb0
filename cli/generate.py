"""`dspark-pd generate`: stream text from the aggregated (single-process) engine."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BUNDLED_TINY = Path(__file__).resolve().parent.parent / "model" / "data" / "tiny"


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    model: str = field(default=str(BUNDLED_TINY), metadata={"help": "checkpoint directory"})
    prompt: str = field(default="Hello! How are you today?", metadata={"help": "prompt text"})
    max_tokens: int = field(default=64, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 is greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    chat: bool = field(default=True, metadata={"help": "wrap the prompt in the checkpoint's chat template"})
    spec: bool = field(default=False, metadata={"help": "speculative decoding with the checkpoint's DSpark drafter"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    dtype: str = field(default="auto", metadata={"help": "float32, bfloat16 or auto (bf16 on GPU, fp32 on CPU)",
                                                  "choices": ["auto", "float32", "bfloat16"]})

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")


def run(cfg: GenerateConfig) -> int:
    import model
    from engine.devices import resolve_device
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from model.tokenizer import IncrementalDecoder, Tokenizer

    dev, dtype = resolve_device(cfg.device, cfg.dtype)
    t0 = time.perf_counter()
    target = model.load(cfg.model, device=dev, dtype=dtype)
    tok = Tokenizer(cfg.model)
    print(f"[loaded {cfg.model} on {dev} as {dtype} in {time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    ids = tok.encode_chat([{"role": "user", "content": cfg.prompt}]) if cfg.chat else tok.encode(cfg.prompt)
    proposer = None
    if cfg.spec:
        from engine.proposer import DSparkProposer
        from model.checkpoint import load_drafter

        proposer = DSparkProposer(load_drafter(cfg.model, device=dev, dtype=dtype), target)
    engine = Engine(target, tok, proposer=proposer)
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, seed=cfg.seed)
    decoder = IncrementalDecoder(tok)
    t1, n, reason = time.perf_counter(), 0, None
    req = engine.add_request(ids, params)
    while req.finish_reason is None:
        for out in engine.step():
            sys.stdout.write(decoder.push(out.new_ids, final=out.finished))
            sys.stdout.flush()
            n += len(out.new_ids)
            reason = out.finish_reason
    dt = time.perf_counter() - t1
    spec = ""
    if cfg.spec:
        spec = f", acceptance length {n / max(1, req.steps):.2f} (drafted {req.drafted}, accepted {req.accepted})"
    print(f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s ({n / dt:.1f} tok/s), finish: {reason}{spec}]",
          file=sys.stderr)
    return 0
