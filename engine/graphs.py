"""CUDA graphs of the decode step: the target's verification forward (K tokens per request, logits included) and
the drafter's proposal, captured at startup over static input buffers. A step copies its padded batch into the
buffers and replays; outputs are the graph's static tensors (valid until the next replay of that graph).

The verification forward reads each request's compressed entries through its block tables, and a graph reads its
tables' whole width, so verification graphs are captured per batch bucket *and* per context level (tables wide
enough for 512, 1024, 2048, ... tokens up to the longest request admitted): a step pays for the longest request in
its batch rounded up to a power of two, not for the service's maximum context. The proposal reads only the
drafter's window, so it has one graph per batch bucket.
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields

import torch

from model.target import ExtendOut, StepBatch

from .allocator import blocks_for
from .proposer import Draft, DraftRows, Proposer
from .runner import ModelRunner

log = logging.getLogger(__name__)


class StepGraphs:
    def __init__(self, runner: ModelRunner, proposer: Proposer | None, k: int, buckets: tuple[int, ...],
                 max_tokens_per_request: int, max_graph_tokens: int = 1 << 20):
        """max_graph_tokens bounds batch rows x context level of a verification graph: its gathered entries are
        held in the graph's memory, so wider steps (rare: many long requests at once) run eagerly instead."""
        self.runner, self.proposer, self.k, self.buckets = runner, proposer, k, tuple(sorted(buckets))
        self.max_graph_tokens = max_graph_tokens
        self.levels = context_levels(max_tokens_per_request)
        self.widths = {t: table_widths(t, runner.ratios, runner.sizing.block_size) for t in self.levels}
        self.capture_layers = proposer.capture if proposer else ()
        self._verify: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StepBatch, ExtendOut, torch.Tensor]] = {}
        self._propose: dict[int, tuple[torch.cuda.CUDAGraph, DraftRows, Draft]] = {}
        self._logits: dict[int, torch.Tensor] = {}  # per batch bucket
        # separate pools: a step replays propose then verify and reads the proposal after verify ran, so the two
        # kinds must not share memory (within a kind only one bucket's graph is live per step)
        self._pools = {"verify": torch.cuda.graph_pool_handle(), "propose": torch.cuda.graph_pool_handle()}
        # our own capture stream on the model's GPU: torch.cuda.graph's default is one stream per process, made on
        # whichever GPU was current at the first capture, so a second engine on another GPU would capture there
        self._stream = torch.cuda.Stream(runner.device)

    def capture(self) -> None:
        t = time.perf_counter()
        # capture and replay under the model's device: streams and graphs belong to the calling thread's current
        # device, which is cuda:0 unless set (a model on cuda:1 otherwise fails with "operation not permitted")
        with torch.cuda.device(self.runner.device):
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its memory
                for level in reversed(self.levels):
                    if level == self.levels[0] or b * level <= self.max_graph_tokens:
                        self._verify[b, level] = self._capture_verify(b, level)
                if self.proposer is not None:
                    self._propose[b] = self._capture_propose(b)
        log.info("captured decode graphs for buckets %s x context levels %s (K=%d) in %.1fs", self.buckets,
                 self.levels, self.k, time.perf_counter() - t)

    def _graph(self, fn, kind: str):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(g, pool=self._pools[kind], stream=self._stream):
            out = fn()
        return g, out

    def _static_batch(self, b: int, level: int) -> StepBatch:
        dev = self.runner.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        return StepBatch(input_ids=z(b, self.k), start=z(b), is_padding=torch.ones(b, dtype=torch.bool, device=dev),
                         slots=z(b), tables={r: z(b, w) for r, w in self.widths[level].items()})

    def _capture_verify(self, b: int, level: int):
        batch = self._static_batch(b, level)
        model, pool = self.runner.model, self.runner.pool

        def fn():
            out = model.extend(batch, pool, capture=self.capture_layers)
            logits = model.logits(out.streams)
            if b not in self._logits:  # first (warm-up) call, outside capture
                self._logits[b] = torch.empty_like(logits)
            # one logits buffer per bucket, shared by its context levels (the largest output; the graph's own copy
            # is freed after capture, so the pool reuses it)
            return out, self._logits[b].copy_(logits)
        g, (out, logits) = self._graph(fn, "verify")
        return g, batch, out, logits

    def _capture_propose(self, b: int):
        dev = self.runner.device
        rows = DraftRows(anchor=torch.zeros(b, dtype=torch.int64, device=dev),
                         start=torch.zeros(b, dtype=torch.int64, device=dev),
                         slots=torch.zeros(b, dtype=torch.int64, device=dev),
                         is_padding=torch.ones(b, dtype=torch.bool, device=dev),
                         temperature=torch.zeros(b, device=dev), top_p=torch.ones(b, device=dev),
                         seed=torch.zeros(b, dtype=torch.int64, device=dev))
        g, draft = self._graph(lambda: self.proposer.propose(self.runner.pool, rows), "propose")
        return g, rows, draft

    def has(self, b: int) -> bool:
        """Graphs exist for batch bucket b (the proposal's; verification's at least for short contexts)."""
        return (b, self.levels[0]) in self._verify

    def verify(self, batch: StepBatch) -> tuple[ExtendOut, torch.Tensor] | None:
        """Replay the graph for this batch's bucket and context level; None if that one was not captured."""
        level = pick_level(self.widths, {r: t.shape[1] for r, t in batch.tables.items()})
        key = (batch.input_ids.shape[0], level)  # (b, None) never exists
        if key not in self._verify:
            return None
        g, static, out, logits = self._verify[key]
        static.input_ids.copy_(batch.input_ids)
        static.start.copy_(batch.start)
        static.is_padding.copy_(batch.is_padding)
        static.slots.copy_(batch.slots)
        for r, t in static.tables.items():
            src = batch.tables[r]
            t.zero_()
            t[:, :src.shape[1]].copy_(src)
        with torch.cuda.device(self.runner.device):
            g.replay()
        return out, logits

    def propose(self, rows: DraftRows) -> Draft:
        g, static, draft = self._propose[rows.anchor.shape[0]]
        for f in fields(DraftRows):
            getattr(static, f.name).copy_(getattr(rows, f.name))
        with torch.cuda.device(self.runner.device):
            g.replay()
        return draft


def context_levels(max_tokens: int, smallest: int = 512) -> tuple[int, ...]:
    """Token capacities of the verification graphs: powers of two from `smallest`, the last one max_tokens."""
    levels, t = [], smallest
    while t < max_tokens:
        levels.append(t)
        t *= 2
    return tuple(levels) + (max_tokens,)


def table_widths(tokens: int, ratios: tuple[int, ...], block_size: int) -> dict[int, int]:
    """Block-table width per compression ratio for requests of up to `tokens` tokens."""
    return {r: max(1, blocks_for(tokens, r, block_size)) for r in ratios}


def pick_level(widths: dict[int, dict[int, int]], needed: dict[int, int]) -> int | None:
    """The smallest context level whose tables are at least as wide as the batch's, for every ratio (None: wider
    than every graph; the step then runs eagerly)."""
    for level in sorted(widths):
        if all(widths[level].get(r, 0) >= w for r, w in needed.items()):
            return level
    return None
