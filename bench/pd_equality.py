"""Compare greedy outputs of a running pair with the aggregated non-speculative engine on the same weights, in one
run (the pair must use the same dtype and simulation settings). Prints matches; never asserts.

    python bench/pd_equality.py --url http://127.0.0.1:8000 --model DIR [--device cuda] [--dtype float32]
                                [--no-qat-sim] [--prompts 8] [--max-tokens 32]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/

import argparse  # noqa: E402

import httpx  # noqa: E402

import model  # noqa: E402
from engine.devices import resolve_device  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.runner import CacheSizing  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--qat-sim", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    dev, dtype = resolve_device(args.device, args.dtype)
    tok = Tokenizer(args.model)
    engine = Engine(model.load(args.model, device=dev, dtype=dtype, qat_sim=args.qat_sim), tok,
                    CacheSizing(max_requests=4, max_tokens=8192))
    name = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    same = 0
    for i in range(args.prompts):
        ids = [0] + [(i * 131 + j * 17) % 990 + 6 for j in range(20 + 37 * i)]
        req = engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens))
        while req.finish_reason is None:
            engine.step()
        r = httpx.post(f"{args.url}/v1/completions", timeout=600, json={
            "model": name, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "logprobs": 0}).json()
        pair = r["choices"][0]["logprobs"]["tokens"]
        mine = [tok.decode([t]) for t in req.output_ids]
        same += pair == mine
        print(f"prompt {i} ({len(ids)} tokens): {'equal' if pair == mine else 'DIFFERENT'}")
    print(f"{same}/{args.prompts} outputs equal the aggregated non-speculative engine ({dev}, {dtype}, "
          f"qat_sim={args.qat_sim})")


if __name__ == "__main__":
    main()
