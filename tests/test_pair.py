"""The whole pair as real processes: prefill (PP=2) + decode over Mooncake TCP, driven through HTTP and the official
`openai` client. Outputs at temperature 0 equal the aggregated non-speculative engine's; bad input gets a 4xx;
disconnects, a dead prefill and heavy concurrency leave nothing behind.

The fp8/fp4 simulations are off on both sides here: with them on, the last-bit differences between a
(b+1)-token verification and one-token steps can flip a rounding and change a later token (model/NOTES.md)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
import torch

import model
from engine.engine import Engine
from engine.runner import CacheSizing
from engine.sampling import SamplingParams
from model.tokenizer import Tokenizer

from .serving import TINY, Service, free_port, start_prefill

NO_SIM = {"DSPARK_QAT_SIM": "0"}
QUESTIONS = ["Hello! How are you today?", "Write a short poem about the sea.", "Numbers: one, two, three",
             "The river ran past the old mill", "Please explain the idea in simple words, with an example."]


class Pair:
    def __init__(self, prefill_port: int, http_port: int, extra=()):
        self.prefill_port, self.http_port = prefill_port, http_port
        self.decode = Service(["serve-decode", "--model", str(TINY), "--prefill", f"127.0.0.1:{prefill_port}",
                               "--port", str(http_port), "--threads", "1", "--max-running", "16",
                               "--max-queued", "64", "--prefill-timeout-s", "20", "--arena-mib", "64", *extra],
                              "decode service ready", env=NO_SIM)
        self.url = f"http://127.0.0.1:{http_port}"

    def wait_ready(self, timeout=60):
        import time
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("decode never became ready")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return float(re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def pair():
    pre, pport = _prefill()
    p = Pair(pport, free_port())
    p.prefill = pre
    p.wait_ready()
    yield p
    p.decode.stop()
    p.prefill.stop()


def _prefill(port=None):
    import os
    old = {k: os.environ.get(k) for k in NO_SIM}
    os.environ.update(NO_SIM)
    try:
        return start_prefill(2, port)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def reference():
    """Greedy answers of the aggregated non-speculative engine (one thread, no simulations)."""
    torch.set_num_threads(1)
    target = model.load(TINY, dtype=torch.float32, qat_sim=False)
    tok = Tokenizer(TINY)
    engine = Engine(target, tok, CacheSizing(max_requests=8, max_tokens=4096))
    out = {}
    for q in QUESTIONS:
        ids = tok.encode_chat([{"role": "user", "content": q}])
        req = engine.add_request(ids, SamplingParams(max_tokens=24))
        while req.finish_reason is None:
            engine.step()
        out[q] = (tok.decode(req.output_ids), len(req.output_ids))
    return out


def _client(pair):
    return openai.AsyncOpenAI(base_url=f"{pair.url}/v1", api_key="x", max_retries=0)


def test_outputs_equal_the_aggregated_engine(pair, reference):
    async def main():
        client = _client(pair)

        async def plain(q):
            r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                     max_tokens=24, temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens

        async def streamed(q):
            s = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                     max_tokens=24, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, usage

        return await asyncio.gather(*[f(q) for q in QUESTIONS for f in (plain, streamed)])

    results = asyncio.run(main())
    for i, q in enumerate(QUESTIONS):
        assert results[2 * i] == reference[q], q
        assert results[2 * i + 1] == reference[q], q


def test_completions_endpoint_and_models(pair):
    async def main():
        client = _client(pair)
        models = await client.models.list()
        r = await client.completions.create(model="tiny", prompt=[0, 4, 200, 300, 5], max_tokens=5, temperature=0,
                                            logprobs=2)
        return models, r

    models, r = asyncio.run(main())
    assert [m.id for m in models.data] == ["tiny"]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5
    assert len(r.choices[0].logprobs.tokens) == 5 and len(r.choices[0].logprobs.top_logprobs[0]) == 2


BAD = [
    ("{not json", 400, "not valid JSON"),
    (json.dumps({"model": "tiny", "messages": "hi"}), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}), 400,
     "temperature"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}), 400,
     "max_tokens"),
    (json.dumps({"model": "tiny", "messages": []}), 400, "messages"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), 404, "model"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 1200}]}), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}), 400,
     "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": [1, 5, 99999]}), 400, "prompt"),
    # a lone surrogate is valid JSON but not Unicode: the tokenizer raised a TypeError (a bare 500) before
    ('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ('{"model": "tiny", "prompt": "a\\udfff"}', 400, "prompt"),
]


@pytest.mark.parametrize("body,status,word", BAD)
def test_bad_input_gets_openai_error(pair, body, status, word):
    path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
    r = httpx.post(f"{pair.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word in err["message"] or word == err.get("param"), err
    assert err["type"]


def test_openai_client_conventions(pair):
    """null for "not set", the developer role (the newer name of system), models.retrieve, and OpenAI-style
    bodies for unknown paths and methods."""
    base = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    system = httpx.post(f"{pair.url}/v1/chat/completions", json={
        **base, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}).json()
    developer = httpx.post(f"{pair.url}/v1/chat/completions", json={
        **base, "n": None, "top_p": None, "stream": None, "logprobs": None,
        "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}).json()
    assert developer["usage"] == system["usage"], developer
    assert developer["choices"][0]["message"] == system["choices"][0]["message"]
    assert asyncio.run(_client(pair).models.retrieve("tiny")).id == "tiny"
    for r in (httpx.get(f"{pair.url}/v1/nothing"), httpx.get(f"{pair.url}/v1/chat/completions"),
              httpx.get(f"{pair.url}/v1/models/gpt-9")):
        assert r.status_code in (404, 405) and r.json()["error"]["message"], r.text


def _idle(pair, quarantined: int = 0) -> None:
    import time
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if pair.metric("running_requests") == 0 and pair.metric("free_cache_slots") == 16:
            break
        time.sleep(0.2)
    assert pair.metric("running_requests") == 0
    assert pair.metric("waiting_requests") == 0
    assert pair.metric("free_cache_slots") == 16
    assert pair.metric("quarantined_regions") == quarantined
    if not quarantined:
        assert pair.metric("free_arena_bytes") == 64 << 20


def test_client_disconnect_mid_stream_frees_everything(pair):
    async def main():
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 900,
                    "temperature": 0.7, "stream": True}
            async with c.stream("POST", f"{pair.url}/v1/chat/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data:")
                    if n >= 4:
                        break  # leave mid-stream
    asyncio.run(main())
    _idle(pair)


def test_32_concurrent_streaming_clients(pair, reference):
    async def main():
        client = _client(pair)

        async def one(i):
            q = QUESTIONS[i % len(QUESTIONS)]
            s = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                     max_tokens=24, temperature=0, stream=True)
            text = ""
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            return q, text
        return await asyncio.gather(*[one(i) for i in range(32)])

    for q, text in asyncio.run(main()):
        assert text == reference[q][0]
    _idle(pair)


def test_dead_prefill_gives_503_and_a_restarted_one_is_picked_up(pair, reference):
    pair.prefill.kill()
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 24,
            "temperature": 0}
    r = httpx.post(f"{pair.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    assert httpx.get(f"{pair.url}/health").status_code == 200
    # the failed request's regions wait out its deadline: decode cannot tell a dead peer from a slow one
    _idle(pair, quarantined=1)
    pair.prefill, _ = _prefill(pair.prefill_port)
    pair.wait_ready()
    r = httpx.post(f"{pair.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference[QUESTIONS[0]][0]
    _idle(pair, quarantined=1)


def test_api_key_and_overload(pair):
    """A second decode service on the same prefill, with an API key and room for one request and no queue."""
    other = Pair(pair.prefill_port, free_port(), extra=["--api-key", "sesame", "--max-running", "1",
                                                        "--max-queued", "0"])
    try:
        other.wait_ready()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{other.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{other.url}/v1/chat/completions", json=body, headers=auth, timeout=30).status_code == 200

        async def two():
            async with httpx.AsyncClient(timeout=60, headers=auth) as c:
                slow = {**body, "max_tokens": 300, "temperature": 0.5}
                first = asyncio.ensure_future(c.post(f"{other.url}/v1/chat/completions", json=slow))
                await asyncio.sleep(0.5)
                second = await c.post(f"{other.url}/v1/chat/completions", json=body)
                return await first, second
        first, second = asyncio.run(two())
        assert first.status_code == 200
        assert second.status_code == 429 and second.headers.get("retry-after") == "1"
    finally:
        other.decode.stop()


def test_chat_logprobs_bytes_rebuild_the_answer(pair):
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 16,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{pair.url}/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] == 16
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
               for e in entries)
    raw = b"".join(bytes(e["bytes"]) for e in entries)
    assert raw.decode("utf-8", errors="replace") == choice["message"]["content"]
