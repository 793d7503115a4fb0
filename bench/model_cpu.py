"""Tokens/s of our prefill and one-token decode step on the tiny preset, beside transformers' DeepseekV4ForCausalLM
on the same weights, in one run. Prints a table with ratios (ours / transformers). Never asserts.

    python bench/model_cpu.py [--prompt 300] [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/ (bench/transfer.py vs transfer/)

import argparse
import tempfile
import time

import torch

import model
from engine.runner import CacheSizing, ModelRunner
from model.synthetic import make_checkpoint


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def ours(m, ids, steps):
    runner = ModelRunner(m, CacheSizing(max_requests=2, max_tokens=4096))

    def prefill():
        rc = runner.new_request()
        runner.prefill(rc, ids[0].tolist(), chunk=4096)
        runner.release(rc)

    def decode():
        rc = runner.new_request()
        runner.prefill(rc, ids[0].tolist(), chunk=4096)
        t = time.perf_counter()
        tok = int(ids[0, -1])
        for _ in range(steps):
            tok = int(runner.step([(rc, [tok])])[0, -1].argmax())
        runner.release(rc)
        return time.perf_counter() - t

    return prefill, decode


def theirs(hf, ids, steps):
    def prefill():
        with torch.no_grad():
            hf(ids)

    def decode():
        with torch.no_grad():
            out = hf(ids, use_cache=True)
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(steps):
                out = hf(tok, cache=cache, use_cache=True)
                cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            return time.perf_counter() - t

    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint("tiny", d, layout="transformers", fmt="fp32", seed=0)
        m = model.load(d, dtype=torch.float32, qat_sim=False)  # transformers has no QAT simulation
        hf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(6, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, (o, t) in {"prefill": (ours(m, ids, args.steps)[0], theirs(hf, ids, args.steps)[0])}.items():
        to, tt = best_of(o, args.repeats), best_of(t, args.repeats)
        rows.append((f"{name} ({args.prompt} tokens)", args.prompt / to, args.prompt / tt))
    od, td = ours(m, ids, args.steps)[1], theirs(hf, ids, args.steps)[1]
    to = min(od() for _ in range(args.repeats))
    tt = min(td() for _ in range(args.repeats))
    rows.append((f"decode step (batch 1, {args.steps} steps)", args.steps / to, args.steps / tt))
    print(f"{'tiny preset, fp32, CPU':<34}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<34}{a:>12.1f}{b:>14.1f}{a / b:>8.2f}")


if __name__ == "__main__":
    main()
