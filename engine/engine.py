"""The aggregated engine: one process holding the target, continuous batching, non-speculative decoding.

Loop: schedule -> prefill the admitted requests -> one batched decode step over the running ones (padded to a
bucket) -> sample -> stop checks. The decode service reuses this loop with speculative steps.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch

from model.target import Transformer
from model.tokenizer import Tokenizer

from .batch import bucket_for
from .request import Request, StepOutput
from .runner import CacheSizing, ModelRunner
from .sampling import TARGET, SamplingParams, probs_from_logits, sample_from_probs
from .scheduler import Scheduler
from .stops import StopChecker

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, sizing: CacheSizing = CacheSizing(),
                 prefill_chunk: int = 512):
        self.runner = ModelRunner(model, sizing)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(self.runner.alloc, sizing.max_requests, lookahead=1)
        self.prefill_chunk = prefill_chunk
        self.stops: dict[str, StopChecker] = {}
        self._ids = itertools.count()

    @property
    def cfg(self):
        return self.runner.model.cfg

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        limit = self.cfg.max_position_embeddings
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context of {limit} tokens")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary (0..{self.cfg.vocab_size - 1}): {bad[:5]}")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params)
        self.stops[req.request_id] = StopChecker(self.tokenizer, params, self._eos)
        self.scheduler.add(req)
        return req

    @property
    def _eos(self) -> int:
        return self.cfg.eos_token_id

    def abort(self, req: Request) -> None:
        self._finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        outputs = [self._prefill(req) for req in sched.prefill]
        live = [r for r in sched.decode if r.finish_reason is None]
        if live:
            outputs += self._decode(live)
        return outputs

    def _prefill(self, req: Request) -> StepOutput:
        self.runner.pool.clear_slot(req.cache.slot)
        ids, chunk = req.prompt_ids, self.prefill_chunk
        for i in range(0, len(ids), chunk):
            batch = self.runner.batch([(req.cache, ids[i:i + chunk])])
            out = self.runner.extend(batch)
            self.runner.commit([req.cache], batch, out, [len(ids[i:i + chunk])])
        with torch.inference_mode():
            logits = self.runner.model.logits(out.streams[:, -1])
        return self._emit([req], logits)[0]

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        rows = [(r.cache, [r.last_token]) for r in reqs]
        batch = self.runner.batch(rows, pad_to=bucket_for(len(rows)))
        out = self.runner.extend(batch)
        self.runner.commit([r.cache for r in reqs], batch, out, [1] * len(reqs))
        with torch.inference_mode():
            logits = self.runner.model.logits(out.streams[: len(reqs), -1])
        return self._emit(reqs, logits)

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """Sample one token per request from logits [B, V] and apply stop rules."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        seed = torch.tensor([r.params.seed for r in reqs], device=dev)
        counter = torch.tensor([len(r.all_ids) for r in reqs], device=dev)
        probs = probs_from_logits(logits, temp, top_p)
        ids = sample_from_probs(probs, seed, counter, TARGET)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
        return [self._append(r, [int(t)], [float(lp)]) for r, t, lp in zip(reqs, ids.tolist(), logp.tolist())]

    def _append(self, req: Request, ids: list[int], logps: list[float]) -> StepOutput:
        stop = self.stops[req.request_id]
        kept, kept_lp, reason = [], [], None
        for t, lp in zip(ids, logps):
            kept.append(t)
            kept_lp.append(lp)
            req.output_ids.append(t)
            req.logprobs.append(lp)
            reason = stop.check(req)
            if reason:
                break
        req.steps += 1
        if reason:
            self._finish(req, reason)
        return StepOutput(req.request_id, kept, kept_lp, reason is not None, reason)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.stops.pop(req.request_id, None)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Run one request to completion, yielding its outputs as they come (other requests also advance)."""
        req = self.add_request(prompt_ids, params)
        while req.finish_reason is None:
            for o in self.step():
                if o.request_id == req.request_id:
                    yield o
