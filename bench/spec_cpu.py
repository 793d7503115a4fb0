"""Speculative vs non-speculative decoding on the tiny preset (CPU), in one run: tokens/s and mean acceptance length
with a random DSpark drafter (mostly rejected) and a drafter forced to propose the target's own tokens (fully
accepted). Prints a table with ratios against the non-speculative run. Never asserts.

    python bench/spec_cpu.py [--requests 4] [--prompt 64] [--max-tokens 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/ (bench/transfer.py vs transfer/)

import argparse
import dataclasses
import time

import torch

from engine.engine import Engine
from engine.proposer import DSparkProposer, ReplayProposer
from engine.runner import CacheSizing
from engine.sampling import SamplingParams
from model.drafter import Drafter
from model.presets import preset
from model.random_init import init_random_
from model.target import Transformer


def run(engine: Engine, prompts: list[list[int]], max_tokens: int):
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    dt = time.perf_counter() - t
    tokens = sum(len(r.output_ids) for r in reqs)
    steps = sum(r.steps for r in reqs)
    return reqs, tokens / dt, tokens / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cfg = dataclasses.replace(preset("tiny"), qat_sim=False)
    target = Transformer(cfg)
    init_random_(target, 0, cfg.n_routed_experts)
    drafter = Drafter(cfg)
    init_random_(drafter, 1, cfg.n_routed_experts)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    sizing = CacheSizing(max_requests=args.requests, max_tokens=args.requests * (args.prompt + args.max_tokens + 16))
    base_reqs, base_tps, _ = run(Engine(target, sizing=sizing), prompts, args.max_tokens)
    expected = {tuple(p): r.output_ids for p, r in zip(prompts, base_reqs)}
    rows = [("non-speculative", base_tps, 1.0, True)]
    for name, proposer in [("DSpark, random drafter", DSparkProposer(drafter, target)),
                           ("forced acceptance", ReplayProposer(expected, cfg.dspark_block_size, cfg.vocab_size))]:
        reqs, tps, acc = run(Engine(target, sizing=sizing, proposer=proposer), prompts, args.max_tokens)
        same = [r.output_ids for r in reqs] == [r.output_ids for r in base_reqs]
        rows.append((name, tps, acc, same))
    print(f"tiny preset, fp32, CPU, {args.requests} requests x {args.max_tokens} tokens, "
          f"block {cfg.dspark_block_size}")
    print(f"{'run':<26}{'tok/s':>9}{'vs non-spec':>13}{'accept len':>12}{'same output':>13}")
    for name, tps, acc, same in rows:
        print(f"{name:<26}{tps:>9.1f}{tps / base_tps:>13.2f}{acc:>12.2f}{str(same):>13}")


if __name__ == "__main__":
    main()
