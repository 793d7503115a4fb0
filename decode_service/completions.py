"""`/v1/chat/completions` and `/v1/completions`: request checks beyond the schema, sampling parameters, and the
OpenAI response shapes (whole or streamed as server-sent events)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.request import StepOutput
from engine.sampling import SamplingParams

from .generation import RequestError, ServiceContext, TextStream, admit, run_admitted
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


async def chat_completions(ctx: ServiceContext, request: Request, body: ChatCompletionRequest):
    _check_model(ctx, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    # "developer" is the newer name of "system" (chat templates know only the latter)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    _check_unicode([m["content"] for m in messages], "messages")
    prompt = await asyncio.to_thread(ctx.tokenizer.encode_chat, messages)  # long prompts: off the event loop
    return await _respond(ctx, request, body, prompt, chat=True, prompt_param="messages")


async def completions(ctx: ServiceContext, request: Request, body: CompletionRequest):
    _check_model(ctx, body.model)
    if isinstance(body.prompt, str):
        _check_unicode([body.prompt], "prompt")
        prompt = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt)
    else:
        prompt = list(body.prompt)
        bad = [t for t in prompt if not 0 <= t < ctx.vocab_size]
        if bad:
            raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (0..{ctx.vocab_size - 1})",
                               param="prompt")
    if not prompt:
        raise RequestError(400, "prompt is empty after tokenisation", param="prompt")
    return await _respond(ctx, request, body, prompt, chat=False, prompt_param="prompt")


def _check_unicode(texts: list[str], param: str) -> None:
    """JSON may carry lone surrogates (\\ud800), which are not Unicode text and cannot be tokenised."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(400, f"{param} holds a character that is not valid Unicode ({e.reason} at "
                                    f"{e.start})", param=param) from None


def _check_model(ctx: ServiceContext, name: str) -> None:
    if name != ctx.model_name:
        raise RequestError(404, f"the model {name!r} does not exist; this server serves {ctx.model_name!r}",
                           param="model")


def _params(ctx, body, prompt: list[int], prompt_param: str) -> list[SamplingParams]:
    room = ctx.max_model_len - len(prompt)
    if room < 1:
        raise RequestError(400, f"the prompt has {len(prompt)} tokens; the context holds {ctx.max_model_len}",
                           param=prompt_param)
    limit_prefill = ctx.peers.max_prompt_tokens if ctx.peers else None
    if limit_prefill is not None and len(prompt) > limit_prefill:
        raise RequestError(400, f"the prompt has {len(prompt)} tokens; the prefill service takes at most "
                                f"{limit_prefill}", param=prompt_param)
    if ctx.receiver.request_bytes(len(prompt)) > ctx.receiver.arena.buffer.numel():
        raise RequestError(400, f"the prompt's state ({len(prompt)} tokens) exceeds the receive arena",
                           param=prompt_param)
    limit = body.limit if body.limit is not None else room
    if limit > room:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise RequestError(400, f"{param} {limit} + the prompt's {len(prompt)} tokens exceed the context of "
                                f"{ctx.max_model_len} tokens", param=param)
    seed = body.seed if body.seed is not None else random.getrandbits(62)
    return [SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=limit, seed=(seed + i) % 2**63,
                           stop=tuple(body.stop or ()), logprobs=body.alternatives) for i in range(body.n)]


async def _respond(ctx, request: Request, body, prompt: list[int], chat: bool, prompt_param: str):
    params = _params(ctx, body, prompt, prompt_param)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    shape = _Shape(ctx, rid, chat, body)
    if body.stream:  # admitted before the 200 goes out, so overload is a real 429
        tickets = await _admit_all(ctx, prompt, params)
        events = _merge([_choice(ctx, t, f"{rid}-{i}", i, prompt, p) for i, (t, p) in enumerate(zip(tickets, params))])
        return StreamingResponse(_sse(shape, events, len(prompt), body.include_usage), media_type="text/event-stream")
    task = asyncio.ensure_future(_collect(ctx, rid, prompt, params))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:  # the client left: cancelling releases everything the request holds
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return JSONResponse({}, status_code=499)
    watcher.cancel()
    return JSONResponse(shape.whole(task.result(), len(prompt)))


async def _admit_all(ctx, prompt, params) -> list[int]:
    tickets = []
    try:
        for p in params:
            tickets.append(await admit(ctx, prompt, p))
    except BaseException:
        for t in tickets:
            ctx.admission.release(t)
        raise
    return tickets


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


class _Choice:
    """What one choice produced so far."""

    def __init__(self, ctx: ServiceContext, index: int, stops: tuple[str, ...]):
        self.index, self.text = index, TextStream(ctx.tokenizer, stops)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None


async def _choice(ctx, ticket, rid, index, prompt, params) -> AsyncIterator[tuple[_Choice, StepOutput, str]]:
    c = _Choice(ctx, index, params.stop)
    t0 = last = time.perf_counter()
    try:
        async for out in run_admitted(ctx, ticket, rid, prompt, params):
            now = time.perf_counter()
            if not c.ids:
                ctx.metrics.ttft.observe(now - t0)
            elif out.new_ids:
                for _ in out.new_ids:
                    ctx.metrics.itl.observe((now - last) / len(out.new_ids))
            last = now
            c.ids += out.new_ids
            c.logprobs += out.new_logprobs
            c.tops += out.new_top_logprobs
            delta = c.text.push(out.new_ids, out.finished)
            if out.finished:
                c.finish_reason = "stop" if c.text.stopped else (out.finish_reason or "stop")
            yield c, out, delta
        ctx.metrics.e2e.observe(time.perf_counter() - t0)
        ctx.metrics.generated.inc(len(c.ids))
        ctx.metrics.requests.labels(c.finish_reason or "stop").inc()
    except RequestError:
        ctx.metrics.requests.labels("error").inc()
        raise
    except (asyncio.CancelledError, GeneratorExit):
        ctx.metrics.requests.labels("abort").inc()
        raise


async def _collect(ctx, rid, prompt, params) -> list[_Choice]:
    async def one(i, p):
        ticket = await admit(ctx, prompt, p)
        c = None
        async for c, _, _ in _choice(ctx, ticket, f"{rid}-{i}", i, prompt, p):
            pass
        return c
    try:  # a failing choice cancels its siblings (they would hold cache for nothing)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i, p)) for i, p in enumerate(params)]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def _merge(gens):
    """Interleave several async generators' items as they come."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for item in g:
                await q.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put(e)
        finally:
            await q.put(done)
    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(shape: "_Shape", events, prompt_tokens: int, include_usage: bool):
    choices: dict[int, _Choice] = {}
    started: set[int] = set()
    try:
        async for c, out, delta in events:
            choices[c.index] = c
            if c.index not in started:
                started.add(c.index)
                if shape.chat:
                    yield _data(shape.chunk(c.index, {"role": "assistant", "content": ""}, None, None))
            lp = (shape.logprobs(out.new_ids, out.new_logprobs, out.new_top_logprobs, c.index)
                  if shape.wants_logprobs else None)
            if delta or lp or c.finish_reason:
                yield _data(shape.chunk(c.index, delta, c.finish_reason, lp))
    except RequestError as e:
        yield _data({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}})
        yield "data: [DONE]\n\n"
        return
    except Exception as e:  # noqa: BLE001 - the stream ends with an error event, never mid-air
        log.exception("stream failed")
        yield _data({"error": {"message": f"internal error: {e}", "type": "server_error", "param": None,
                               "code": None}})
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        done = sum(len(c.ids) for c in choices.values())
        yield _data({**shape.head("chunk"), "choices": [], "usage": _usage(prompt_tokens, done)})
    yield "data: [DONE]\n\n"


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Shape:
    """OpenAI JSON shapes for one response."""

    def __init__(self, ctx: ServiceContext, rid: str, chat: bool, body):
        self.ctx, self.rid, self.chat = ctx, rid, chat
        self.created = int(time.time())
        self.wants_logprobs = body.alternatives is not None
        self.include_usage = body.include_usage
        self.text_offset: dict[int, int] = {}  # legacy completions: per choice, offsets run on across chunks

    def head(self, kind: str) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if kind == "chunk" and self.chat
                                                                         else "")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.ctx.model_name}

    def chunk(self, index: int, delta, finish: str | None, logprobs) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        chunk = {**self.head("chunk"), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # only the final chunk carries usage
        return chunk

    def whole(self, choices: list[_Choice], prompt_tokens: int) -> dict:
        out = []
        for c in choices:
            text = _cut(c)
            lp = self.logprobs(c.ids, c.logprobs, c.tops, c.index) if self.wants_logprobs else None
            if self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {**self.head("whole"), "choices": out, "usage": _usage(prompt_tokens, sum(len(c.ids) for c in choices))}

    def logprobs(self, ids: list[int], lps: list[float], tops: list, index: int = 0) -> dict:
        tok = self.ctx.tokenizer
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                raw = tok.token_bytes(t)
                return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                                for t, lp, top in zip(ids, lps, tops or [[]] * len(ids))]}
        strs = [tok.decode([t]) for t in ids]
        offsets, pos = [], self.text_offset.get(index, 0)
        for s in strs:
            offsets.append(pos)
            pos += len(s)
        self.text_offset[index] = pos
        return {"tokens": strs, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{tok.decode([a]): v for a, v in top} for top in (tops or [[]] * len(ids))]}


def _cut(c: _Choice) -> str:
    text = c.text.tokenizer.decode(c.text.ids)
    cuts = [i for i in (text.find(s) for s in c.text.stops) if i >= 0]
    return text[:min(cuts)] if cuts else text
