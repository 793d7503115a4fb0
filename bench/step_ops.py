"""Count the PyTorch operations of one speculative decode step, by phase and by source function, on the CPU.

On the GPU a small model's decode step is bound by kernel launches, not by memory traffic (the `small` preset's
step takes ~8 ms against a 0.25-0.8 ms HBM roofline), so the number of operations is the figure to drive down:
what runs outside the CUDA graphs ("other") costs host time per op; what runs inside them costs one GPU kernel
each. Counted as the GPU would run them: MoE on the dense path, each Triton kernel (Sinkhorn, router, acceptance)
as one operation.

    python bench/step_ops.py [--model model/data/tiny] [--requests 8] [--top 25] [--no-qat-sim]

Never asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/ (bench/transfer.py vs transfer/)

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import kernels.acceptance
import kernels.router
import kernels.sinkhorn
import model.moe
from engine.engine import Engine
from engine.proposer import DSparkProposer
from engine.runner import CacheSizing
from engine.sampling import SamplingParams
from model.checkpoint import load, load_drafter

ROOT = str(Path(__file__).resolve().parent.parent) + "/"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.phase = ["other"]

    def add(self, where: str) -> None:
        self.counts[(self.phase[-1], where)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and not (f.f_code.co_filename.startswith(ROOT) and "/bench/" not in f.f_code.co_filename
                                     and ".venv" not in f.f_code.co_filename):
            f = f.f_back
        self.add(f"{f.f_code.co_filename[len(ROOT):]}:{f.f_code.co_name}" if f else "?")
        return func(*args, **(kwargs or {}))


def as_one_op(mod, name: str, counter: Counter, label: str) -> None:
    """Run mod.name uncounted and count it as one operation (a Triton launch on the GPU)."""
    ref = getattr(mod, name)

    def one(*a, **k):
        with _disable_current_modes():
            out = ref(*a, **k)
        counter.add(label)
        return out
    setattr(mod, name, one)


def in_phase(obj, name: str, counter: Counter, label: str) -> None:
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        counter.phase.append(label)
        try:
            return fn(*a, **k)
        finally:
            counter.phase.pop()
    setattr(obj, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="model/data/tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--qat-sim", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load(args.model, "cpu", torch.float32, qat_sim=args.qat_sim)
    drafter = load_drafter(args.model, "cpu", torch.float32, qat_sim=args.qat_sim)
    eng = Engine(target, sizing=CacheSizing(max_requests=args.requests, max_tokens=1 << 14, block_size=16),
                 proposer=DSparkProposer(drafter, target))
    for i in range(args.requests):
        eng.add_request(list(range(5, 40 + i)), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):  # prefill and first steps
        eng.step()

    counter = Counter()
    model.moe.Experts.forward = lambda self, x, w, ids: self.dense(x, w, ids)  # the GPU's decode path
    as_one_op(kernels.sinkhorn, "sinkhorn_ref", counter, "Triton: sinkhorn")
    as_one_op(kernels.router, "route_ref", counter, "Triton: router")
    as_one_op(kernels.acceptance, "accept_ref", counter, "Triton: acceptance")
    in_phase(eng.runner, "extend", counter, "verify (graphed)")
    in_phase(eng.proposer, "propose", counter, "propose (graphed)")
    with counter:
        for _ in range(args.steps):
            eng.step()

    per_phase = collections.Counter()
    for (phase, _), n in counter.counts.items():
        per_phase[phase] += n
    cfg = target.cfg
    print(f"{args.model}: {cfg.num_hidden_layers} layers, {args.requests} requests, block {cfg.dspark_block_size}, "
          f"qat_sim={args.qat_sim}; operations per decode step")
    for phase, n in per_phase.most_common():
        print(f"  {phase:<20}{n / args.steps:>8.0f}")
    print(f"  {'total':<20}{sum(per_phase.values()) / args.steps:>8.0f}")
    print(f"\ntop {args.top} sources")
    for (phase, where), n in counter.counts.most_common(args.top):
        print(f"  {n / args.steps:>7.0f}  {phase:<18} {where}")


if __name__ == "__main__":
    main()
