"""CUDA graphs of the decode step: the target's verification forward (K tokens per request, logits included) and
the drafter's proposal, captured once per batch bucket over static input buffers at startup. A step copies its
padded batch into the bucket's buffers and replays; outputs are the graph's static tensors (valid until the next
replay of that bucket). Block tables are padded to a fixed width (the longest request the service admits).
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields

import torch

from model.target import ExtendOut, StepBatch

from .proposer import Draft, DraftRows, Proposer
from .runner import ModelRunner

log = logging.getLogger(__name__)


class StepGraphs:
    def __init__(self, runner: ModelRunner, proposer: Proposer | None, k: int, buckets: tuple[int, ...],
                 max_tokens_per_request: int):
        self.runner, self.proposer, self.k, self.buckets = runner, proposer, k, tuple(sorted(buckets))
        bs = runner.sizing.block_size
        self.widths = {r: max(1, -(-(max_tokens_per_request // r) // bs)) for r in runner.ratios}
        self.capture_layers = proposer.capture if proposer else ()
        self._verify: dict[int, tuple[torch.cuda.CUDAGraph, StepBatch, ExtendOut, torch.Tensor]] = {}
        self._propose: dict[int, tuple[torch.cuda.CUDAGraph, DraftRows, Draft]] = {}
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
                self._verify[b] = self._capture_verify(b)
                if self.proposer is not None:
                    self._propose[b] = self._capture_propose(b)
        log.info("captured decode graphs for buckets %s (K=%d) in %.1fs", self.buckets, self.k,
                 time.perf_counter() - t)

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

    def _static_batch(self, b: int) -> StepBatch:
        dev = self.runner.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        return StepBatch(input_ids=z(b, self.k), start=z(b), is_padding=torch.ones(b, dtype=torch.bool, device=dev),
                         slots=z(b), tables={r: z(b, w) for r, w in self.widths.items()})

    def _capture_verify(self, b: int):
        batch = self._static_batch(b)
        model, pool = self.runner.model, self.runner.pool

        def fn():
            out = model.extend(batch, pool, capture=self.capture_layers)
            return out, model.logits(out.streams)
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
        return b in self._verify

    def verify(self, batch: StepBatch) -> tuple[ExtendOut, torch.Tensor]:
        g, static, out, logits = self._verify[batch.input_ids.shape[0]]
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
