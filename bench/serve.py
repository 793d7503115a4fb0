"""Drive a running decode service's OpenAI endpoint at several concurrency levels (like `vllm bench serve`) and
print TTFT, inter-token latency, output tokens/s and the acceptance length (from /metrics) per level.

    python bench/serve.py --url http://127.0.0.1:8000 [--concurrency 1,8,32] [--requests 32] [--prompt 256]
                          [--max-tokens 128]

Prompts are random token ids (the completions endpoint), so no tokenizer behaviour is measured. Requests ask for
`logprobs: 0` so that every engine step sends a chunk: the service sends no chunk for tokens that decode to no text,
and a synthetic checkpoint's tokenizer covers only ~1000 of its ids (the `small` preset samples from 32768), so
without it the first chunk would come many tokens after the first token. Never asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/ (bench/transfer.py vs transfer/)

import argparse
import asyncio
import random
import re
import statistics
import time

import httpx


def metric_sum(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


LOGPROBS = {"logprobs": 0}  # a chunk per step, text or not (see the module docstring)


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **LOGPROBS}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - t0 if stamps else float("nan"), "gaps": gaps, "chunks": len(stamps),
            "e2e": time.perf_counter() - t0}


async def level(url: str, model: str, conc: int, n: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    rng = random.Random(conc)
    prompts = [[rng.randrange(6, vocab) for _ in range(prompt_len)] for _ in range(n)]
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=600) as client:
        before = (await client.get(f"{url}/metrics")).text

        async def run(p):
            async with sem:
                return await one(client, url, model, p, max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
        after = (await client.get(f"{url}/metrics")).text
    tokens = metric_sum(after, "generated_tokens_total") - metric_sum(before, "generated_tokens_total")
    acc_n = metric_sum(after, "acceptance_length_count") - metric_sum(before, "acceptance_length_count")
    acc_s = metric_sum(after, "acceptance_length_sum") - metric_sum(before, "acceptance_length_sum")
    gaps = [g for r in results for g in r["gaps"]]
    per_token_itl = tokens and sum(gaps) / max(1.0, tokens - n)
    return {"conc": conc, "ttft_ms": statistics.median(r["ttft"] for r in results) * 1e3,
            "itl_ms": per_token_itl * 1e3, "tok_s": tokens / wall, "acc": acc_s / acc_n if acc_n else float("nan"),
            "e2e_s": statistics.median(r["e2e"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--label", default="")
    ap.add_argument("--text-chunks", action="store_true",
                    help="no logprobs: chunks only when text appears (TTFT is then the first visible text)")
    args = ap.parse_args()
    if args.text_chunks:
        LOGPROBS.clear()
    models = httpx.get(f"{args.url}/v1/models").json()["data"]
    model = models[0]["id"]
    vocab = 1000
    rows = [asyncio.run(level(args.url, model, int(c), max(args.requests, int(c)), args.prompt, args.max_tokens,
                              vocab)) for c in args.concurrency.split(",")]
    print(f"{args.label} model {model}, prompt {args.prompt} tokens, {args.max_tokens} output tokens")
    print(f"{'conc':>5}{'TTFT p50 ms':>13}{'ITL ms/token':>14}{'output tok/s':>14}{'accept len':>12}"
          f"{'e2e p50 s':>11}")
    for r in rows:
        print(f"{r['conc']:>5}{r['ttft_ms']:>13.1f}{r['itl_ms']:>14.2f}{r['tok_s']:>14.1f}{r['acc']:>12.2f}"
              f"{r['e2e_s']:>11.2f}")


if __name__ == "__main__":
    main()
