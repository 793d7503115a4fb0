"""The aggregated engine: one process holding the target (and optionally a draft proposer), continuous batching.

Loop: schedule -> prefill the admitted requests -> one batched decode step over the running ones (padded to a
bucket) -> sample -> stop checks. With a proposer, a decode step drafts a block per request, verifies anchor +
drafts in one target extend, accepts (greedy or rejection sampling), and commits only what was accepted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch

from kernels.acceptance import accept
from kernels.step_inputs import verify_inputs
from model.target import Transformer
from model.tokenizer import Tokenizer

from .batch import BUCKETS, bucket_for
from .graphs import StepGraphs
from .proposer import DraftRows, Proposer
from .request import Request, StepOutput
from .runner import CacheSizing, ModelRunner
from .sampling import (
    ACCEPT,
    TARGET,
    SamplingParams,
    probs_from_logits,
    sample_from_probs,
    uniform,
)
from .scheduler import Scheduler
from .stops import StopChecker

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, sizing: CacheSizing = CacheSizing(),
                 prefill_chunk: int = 512, proposer: Proposer | None = None, cuda_graphs: bool = False,
                 max_model_len: int | None = None):
        """cuda_graphs: capture the decode step per batch bucket (CUDA only); max_model_len bounds one request's
        tokens (it sets the graphs' block-table width)."""
        self.proposer = proposer
        self.runner = ModelRunner(model, sizing, extra_layers=proposer.layers if proposer else ())
        self.tokenizer = tokenizer
        lookahead = proposer.block_size + 1 if proposer else 1
        self.scheduler = Scheduler(self.runner.alloc, sizing.max_requests, lookahead=lookahead)
        self.prefill_chunk = prefill_chunk
        self.stops: dict[str, StopChecker] = {}
        self._ids = itertools.count()
        self.graphs = None
        if cuda_graphs and self.runner.device.type == "cuda":
            limit = max_model_len or min(model.cfg.max_position_embeddings, sizing.max_tokens)
            buckets = tuple(b for b in BUCKETS if b <= bucket_for(sizing.max_requests))
            self.graphs = StepGraphs(self.runner, proposer, lookahead, buckets, limit + lookahead)
            self.graphs.capture()

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
        req = self._new_request(prompt_ids, params, request_id)
        self.scheduler.add(req)
        return req

    def _new_request(self, prompt_ids, params, request_id) -> Request:
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params)
        self.stops[req.request_id] = StopChecker(self.tokenizer, params, self._eos)
        return req

    def install(self, prompt_ids: list[int], params: SamplingParams, first: tuple[int, float, list],
                unpack, request_id: str | None = None) -> tuple[Request, StepOutput]:
        """Admit a request prefilled elsewhere: unpack(pool, slot, tables) writes its state into the cache, and
        `first` = (token, logprob, top alternatives) is its first output token (already sampled by prefill)."""
        req = self._new_request(prompt_ids, params, request_id)
        try:
            self.scheduler.admit_now(req)
        except Exception:
            self.stops.pop(req.request_id, None)
            raise
        try:
            self.runner.pool.clear_slot(req.cache.slot)
            unpack(self.runner.pool, req.cache.slot, req.cache.tables)
        except Exception:
            self._finish(req, "abort")
            raise
        req.cache.tokens = len(prompt_ids)
        token, logprob, top = first
        return req, self._append(req, [token], [logprob], [top] if params.logprobs else [])

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
        capture = self.proposer.capture if self.proposer else ()
        for i in range(0, len(ids), chunk):
            part = ids[i:i + chunk]
            batch = self.runner.batch([(req.cache, part)])
            out = self.runner.extend(batch, capture=capture)
            self.runner.commit([req.cache], batch, out, [len(part)])
            if self.proposer:
                self.proposer.extend_context(self.runner.pool, batch, out.aux, self._tensor([len(part)]))
        with torch.inference_mode():
            logits = self.runner.model.logits(out.streams[:, -1])
        return self._emit([req], logits)[0]

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.runner.device)

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        if self.proposer:
            return self._spec_decode(reqs)
        rows = [(r.cache, [r.last_token]) for r in reqs]
        batch = self.runner.batch(rows, pad_to=bucket_for(len(rows)))
        out, logits = self._verify(batch, ())
        self.runner.commit([r.cache for r in reqs], batch, out, [1] * len(reqs))
        return self._emit(reqs, logits[: len(reqs), -1])

    def _verify(self, batch, capture) -> tuple:
        """The target forward of a decode step (graphed when a graph exists for the bucket): (out, logits)."""
        graphed = self.graphs.verify(batch) if self.graphs is not None else None  # None: no graph for it
        if graphed is not None:
            return graphed
        out = self.runner.extend(batch, capture=capture)
        with torch.inference_mode():
            return out, self.runner.model.logits(out.streams)

    def _spec_decode(self, reqs: list[Request]) -> list[StepOutput]:
        b, bp, n_real = self.proposer.block_size, bucket_for(len(reqs)), len(reqs)
        pad = bp - n_real
        rows = self._draft_rows(reqs, pad)
        if self.graphs is not None and self.graphs.has(bp):
            draft = self.graphs.propose(rows)
        else:
            draft = self.proposer.propose(self.runner.pool, rows)
        batch = self.runner.batch([(r.cache, [0] * (b + 1)) for r in reqs], pad_to=bp)
        ids, _ = verify_inputs(rows.anchor, draft.tokens, rows.start, n_real)  # drafts stay on the device
        batch = dataclasses.replace(batch, input_ids=ids)
        out, logits = self._verify(batch, self.proposer.capture)  # logits [bp, b+1, V]
        v = logits.shape[-1]
        p = probs_from_logits(logits.flatten(0, 1), rows.temperature.repeat_interleave(b + 1),
                              rows.top_p.repeat_interleave(b + 1),
                              all_greedy=all(r.params.greedy for r in reqs)).view(bp, b + 1, v)
        pos = rows.start[:, None] + 1 + torch.arange(b + 1, device=logits.device)  # positions of emitted tokens
        u_acc = uniform(rows.seed, pos[:, 0], ACCEPT, b)  # one lane per draft position of this step
        n_acc, last = accept(p, draft.probs, draft.tokens, u_acc, self._pick_uniform(rows.seed, pos))
        accepted = (n_acc + 1).masked_fill(rows.is_padding, 0)
        # commit from the device tensor: the host learns the counts only at the one transfer below, so it can keep
        # queueing this step's work while the GPU is still verifying
        self.runner.commit_state(batch, out, accepted)
        self.proposer.extend_context(self.runner.pool, batch, out.aux, accepted)
        logp = torch.log_softmax(logits, -1)
        emitted = torch.cat((draft.tokens, last[:, None]), 1)  # accepted drafts, then `last` at position n
        emitted.scatter_(1, n_acc[:, None], last[:, None])
        emitted_lp = logp.gather(-1, emitted[..., None]).squeeze(-1)
        tops = _top_logprobs(logp[:n_real], reqs)
        # one transfer to the host for the whole batch: counts, token ids and logprobs packed as float64 (exact
        # for ids below 2**53)
        host = torch.cat((n_acc[:, None].double(), emitted.double(), emitted_lp.double()), 1)[:n_real].tolist()
        outputs = []
        for i, (r, row) in enumerate(zip(reqs, host)):
            n = int(row[0])
            ids, lps = [int(t) for t in row[1:n + 2]], row[b + 2:b + 3 + n]
            r.cache.tokens += n + 1
            r.drafted, r.accepted = r.drafted + b, r.accepted + n
            outputs.append(self._append(r, ids, lps, tops[i][:n + 1]))
        return outputs

    @staticmethod
    def _pick_uniform(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One TARGET-stream uniform per row, keyed by the step's anchor position (first emitted position)."""
        return uniform(seed, pos[:, 0], TARGET, 1)[:, 0]

    def _draft_rows(self, reqs: list[Request], pad: int) -> DraftRows:
        t = self._tensor
        return DraftRows(
            anchor=t([r.last_token for r in reqs] + [0] * pad),
            start=t([r.cache.tokens for r in reqs] + [0] * pad),
            slots=t([r.cache.slot for r in reqs] + [0] * pad),
            is_padding=t([False] * len(reqs) + [True] * pad, torch.bool),
            temperature=t([r.params.temperature for r in reqs] + [0.0] * pad, torch.float32),
            top_p=t([r.params.top_p for r in reqs] + [1.0] * pad, torch.float32),
            seed=t([r.params.seed for r in reqs] + [0] * pad))

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """Sample one token per request from logits [B, V] and apply stop rules."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        seed = torch.tensor([r.params.seed for r in reqs], device=dev)
        counter = torch.tensor([len(r.all_ids) for r in reqs], device=dev)
        probs = probs_from_logits(logits, temp, top_p, all_greedy=all(r.params.greedy for r in reqs))
        ids = sample_from_probs(probs, seed, counter, TARGET)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
        tops = _top_logprobs(logp_all[:, None], reqs)
        host = torch.stack((ids.double(), logp.double()), 1).tolist()  # one transfer: ids exact below 2**53
        return [self._append(r, [int(t)], [lp], top) for r, (t, lp), top in zip(reqs, host, tops)]

    def _append(self, req: Request, ids: list[int], logps: list[float], tops: list | None = None) -> StepOutput:
        stop = self.stops[req.request_id]
        kept, reason = 0, None
        for t, lp in zip(ids, logps):
            kept += 1
            req.output_ids.append(t)
            req.logprobs.append(lp)
            reason = stop.check(req)
            if reason:
                break
        tops = (tops or [])[:kept]
        req.top_logprobs.extend(tops)
        req.steps += 1
        if reason:
            self._finish(req, reason)
        return StepOutput(req.request_id, ids[:kept], logps[:kept], reason is not None, reason, tops)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.stops.pop(req.request_id, None)


def _top_logprobs(logp: torch.Tensor, reqs: list[Request]) -> list[list[list[tuple[int, float]]]]:
    """logp [B, K, V] -> per request, per position, its `params.logprobs` most likely (token, logprob)."""
    k = max((r.params.logprobs or 0) for r in reqs)
    if k == 0:
        return [[] for _ in reqs]
    top = logp.topk(k, dim=-1)
    ids, vals = top.indices.tolist(), top.values.tolist()
    return [[list(zip(i[: r.params.logprobs or 0], v[: r.params.logprobs or 0])) for i, v in zip(ids[b], vals[b])]
            if r.params.logprobs else [[] for _ in ids[b]] for b, r in enumerate(reqs)]
