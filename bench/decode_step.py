"""Where a decode step's time goes, against the memory roofline, in one run.

For each batch size: the engine's whole decode step (ms), the replay of its CUDA graphs alone (GPU time of the
verify and propose graphs), the rest (host work: batch building, sampling, acceptance, commit, the transfer to the
host), and the step's weight traffic over the copy bandwidth measured in the same run (the roofline: a step cannot
be faster than reading the weights it touches once). On the CPU the graph columns are empty (eager steps).

    python bench/decode_step.py --model checkpoints/small [--device cuda] [--batch 1,8,32] [--prompt 256]
                                [--no-spec] [--steps 20]

Weight traffic per step: every non-expert weight once, plus the routed experts the step touches; the GPU's graphed
decode runs MoE densely (every expert), so on the GPU that is all experts, on the CPU the expected number of
distinct experts for the batch's tokens. KV-cache reads are left out (small next to the weights at these lengths).
Never asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/ (bench/transfer.py vs transfer/)

import argparse
import random
import time

import torch

from engine.devices import resolve_device
from engine.allocator import blocks_for
from engine.batch import bucket_for
from engine.engine import Engine
from engine.graphs import pick_level
from engine.proposer import DSparkProposer
from engine.runner import CacheSizing
from engine.sampling import SamplingParams
from model.checkpoint import load, load_drafter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t, n = time.perf_counter(), 5
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - t)


def weight_bytes(model: torch.nn.Module, expert_fraction: float) -> int:
    """Bytes of weights one step reads: routed experts scaled by the fraction touched, the embedding as rows only."""
    total = 0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if ".experts." in name or name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            b = int(b * expert_fraction)
        elif name.endswith("embed.weight"):
            continue
        total += b
    return total


def touched_fraction(tokens: int, k: int, e: int) -> float:
    """Expected share of e experts hit by `tokens` independent top-k routings."""
    return 1 - (1 - k / e) ** tokens


def seconds_per_call(fn, steps: int, device: torch.device) -> float:
    """Mean wall time of fn() over `steps` calls, the device drained before and after."""
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / steps


def time_replays(graphs: dict, key, steps: int, device: torch.device) -> float:
    if key not in graphs:
        return float("nan")
    g = graphs[key][0]
    g.replay()  # warm
    return seconds_per_call(g.replay, steps, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--spec", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    device, dtype = resolve_device(args.device, args.dtype)
    target = load(args.model, device, dtype)
    proposer = None
    if args.spec and target.cfg.dspark_num_layers:
        proposer = DSparkProposer(load_drafter(args.model, device, dtype), target)
    batches = [int(b) for b in args.batch.split(",")]
    cfg = target.cfg
    per_request = args.prompt + 8 * args.steps * ((proposer.block_size + 1) if proposer else 1) + 64
    eng = Engine(target, sizing=CacheSizing(max_requests=max(batches), max_tokens=max(batches) * per_request,
                                            block_size=64),
                 proposer=proposer, cuda_graphs=device.type == "cuda", max_model_len=per_request)
    bw = copy_bandwidth(device)
    k = (proposer.block_size + 1) if proposer else 1
    print(f"{args.model} on {device} ({dtype}), {'DSpark block ' + str(k - 1) if proposer else 'no speculation'}, "
          f"prompt {args.prompt}; copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'batch':>6}{'step ms':>10}{'verify graph ms':>17}{'propose graph ms':>18}{'host ms':>10}"
          f"{'weights GB':>12}{'roofline ms':>13}{'step / roofline':>17}")
    rng = random.Random(0)
    for b in batches:
        params = SamplingParams(max_tokens=per_request - args.prompt - k, ignore_eos=True)
        reqs = [eng.add_request([rng.randrange(6, cfg.vocab_size) for _ in range(args.prompt)], params)
                for _ in range(b)]
        while any(not r.output_ids for r in reqs):  # prefill
            eng.step()
        eng.step()
        step = seconds_per_call(eng.step, args.steps, device)
        graphs, bucket, bs = eng.graphs, bucket_for(b), eng.runner.sizing.block_size
        # the level a step of these requests replays (tables cover the tokens after the step, as make_batch cuts)
        level = graphs and pick_level(graphs.widths, {r: max(blocks_for(q.cache.tokens + k, r, bs) for q in reqs)
                                                      for r in eng.runner.ratios})
        verify = time_replays(graphs._verify, (bucket, level), args.steps, device) if graphs else float("nan")
        propose = (time_replays(graphs._propose, bucket, args.steps, device) if graphs and proposer
                   else (0.0 if graphs else float("nan")))
        host = step - verify - propose if graphs else float("nan")
        dense = device.type == "cuda"
        frac = 1.0 if dense else touched_fraction(b * k, cfg.num_experts_per_tok, cfg.n_routed_experts)
        nbytes = weight_bytes(target, frac) + (weight_bytes(proposer.drafter, frac) if proposer else 0)
        roof = nbytes / bw
        print(f"{b:>6}{step * 1e3:>10.2f}{verify * 1e3:>17.2f}{propose * 1e3:>18.2f}{host * 1e3:>10.2f}"
              f"{nbytes / 1e9:>12.2f}{roof * 1e3:>13.3f}{step / roof:>17.1f}")
        for r in reqs:
            if r.finish_reason is None:
                eng.abort(r)
        while eng.has_work():
            eng.step()


if __name__ == "__main__":
    main()
