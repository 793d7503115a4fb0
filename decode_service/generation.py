"""One completion's life on the decode side: admit -> reserve regions -> Prefill RPC -> install into the engine ->
stream engine outputs -> release. Every exit path (finish, error, client gone) gives back what it took."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.request import StepOutput
from engine.sampling import SamplingParams
from model.tokenizer import IncrementalDecoder, Tokenizer
from proto import prefill_pb2
from transfer.arena import ArenaFull

from .admission import Admission, Overloaded
from .config import DecodeConfig
from .kv_receiver import KVReceiver
from .metrics import DecodeMetrics
from .prefill_client import PrefillPeers, PrefillUnavailable
from .worker import EngineWorker, Failed, Install

log = logging.getLogger(__name__)


class RequestError(Exception):
    """Ends a request with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}


@dataclass
class ServiceContext:
    cfg: DecodeConfig
    model_name: str
    tokenizer: Tokenizer
    worker: EngineWorker
    receiver: KVReceiver
    peers: PrefillPeers | None
    admission: Admission
    metrics: DecodeMetrics
    layout_hash: str
    vocab_size: int
    lookahead: int
    eos_id: int | None = None
    max_model_len: int = 0
    started: float = field(default_factory=time.time)


async def admit(ctx: ServiceContext, prompt: list[int], params: SamplingParams) -> int:
    """Take an admission ticket (waiting in the bounded queue if needed); returns its size for `run_admitted`."""
    tokens = len(prompt) + params.max_tokens + ctx.lookahead
    try:
        await ctx.admission.acquire(tokens)
    except Overloaded as e:
        raise RequestError(429, f"server overloaded: {e}; retry later", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from e
    except ValueError as e:
        raise RequestError(400, str(e), param="max_tokens") from e
    return tokens


async def run_admitted(ctx: ServiceContext, ticket: int, rid: str, prompt: list[int], params: SamplingParams
                       ) -> AsyncIterator[StepOutput]:
    """Prefill and decode one admitted request; gives the ticket back at the end, however it ends."""
    try:
        async for out in _prefill_and_decode(ctx, rid, prompt, params):
            yield out
    finally:
        ctx.admission.release(ticket)


async def _prefill_and_decode(ctx, rid, prompt, params) -> AsyncIterator[StepOutput]:
    try:
        res = ctx.receiver.reserve(len(prompt), ctx.cfg.prefill_timeout_s)
    except ArenaFull as e:
        raise RequestError(503, f"receive arena full: {e}", kind="server_error", headers={"Retry-After": "1"}) from e
    queue = ctx.worker.open(rid)
    installed = False
    try:
        reply = await _prefill(ctx, rid, prompt, params, res)
        first = (reply.first_token, reply.first_logprob, [(t.token, t.logprob) for t in reply.first_top_logprobs])
        ctx.worker.install(Install(rid, prompt, params, first, res))  # the worker releases the regions
        installed = True
        while True:
            item = await queue.get()
            if isinstance(item, Failed):
                raise RequestError(503, f"request {rid} failed in the engine: {item}", kind="server_error")
            yield item
            if item.finished:
                return
    finally:
        ctx.worker.close(rid)
        if installed:
            ctx.worker.abort(rid)  # a no-op when it finished; frees the cache when the client left early


async def _prefill(ctx, rid, prompt, params, res) -> prefill_pb2.PrefillReply:
    req = prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, layout_hash=ctx.layout_hash, destination=ctx.receiver.destination(res),
        sampling=prefill_pb2.Sampling(temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                                      top_logprobs=params.logprobs or 0))
    t0 = time.perf_counter()

    def abandoned(acked: bool) -> None:  # the client left during prefill; called once the peer answered the cancel
        ctx.receiver.release(res, safe=acked)
        log.info("request %s: client gone during prefill (cancel %s)", rid, "acknowledged" if acked else "unsure")

    try:
        reply = await ctx.peers.prefill(req, ctx.cfg.prefill_timeout_s, abandoned)
    except PrefillUnavailable as e:
        ctx.receiver.release(res, safe=e.safe)
        log.warning("request %s: %s", rid, e)
        raise RequestError(503, str(e), kind="server_error", headers={"Retry-After": "1"}) from e
    except asyncio.CancelledError:
        raise  # `abandoned` releases the regions
    except BaseException:
        ctx.receiver.release(res, safe=False)
        raise
    ctx.metrics.kv_seconds.observe(time.perf_counter() - t0)
    ctx.metrics.kv_bytes.inc(reply.bytes_moved)
    return reply


class TextStream:
    """Detokenises one choice incrementally, holding back text that could still turn into a stop string and cutting
    the output where a stop string begins. Work per push is bounded by the new text plus the held-back tail."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.decoder, self.stops = tokenizer, IncrementalDecoder(tokenizer), stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # decoded so far (up to the decoder's last clean point)
        self.sent = 0
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

    def push(self, ids: list[int], final: bool) -> str:
        self.text += self.decoder.push(ids, final)
        text, end = self.text, len(self.text)
        # a stop string never begins before `sent`: the held-back tail is longer than any stop string minus one
        cuts = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        if cuts:
            end, final, self.stopped = min(cuts), True, True
        elif not final:
            end = max(self.sent, end - self.hold)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta
