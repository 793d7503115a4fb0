"""Incremental detokenisation (streaming text, stop strings) equals decoding the whole output, on outputs full of
tokens that hold parts of UTF-8 characters, invalid bytes and special tokens."""

from __future__ import annotations

import random

import pytest

from decode_service.generation import TextStream
from engine.request import Request
from engine.sampling import SamplingParams
from engine.stops import StopChecker
from model.tokenizer import IncrementalDecoder, Tokenizer

TOK = Tokenizer("model/data/tiny")


def outputs(n: int = 40, length: int = 120):
    """Random id sequences (a third of the bundled vocabulary are partial characters), and encoded text with
    multi-byte characters, pushed in random group sizes (a speculative step appends several tokens at once)."""
    rng = random.Random(0)
    texts = ["héllo wörld — ünïcödé ✓ 日本語テキスト and emoji 🎉🎉 done", "plain ascii text with a STOP inside"]
    seqs = [[rng.randrange(TOK.vocab_size + 20) for _ in range(length)] for _ in range(n)]  # some ids unknown
    seqs += [TOK.encode(t) for t in texts]
    for ids in seqs:
        groups, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 6)
            groups.append(ids[i:i + k])
            i += k
        yield ids, groups


def test_incremental_decoder_equals_the_whole_decode():
    for ids, groups in outputs():
        dec = IncrementalDecoder(TOK)
        pieces = [dec.push(g, final=j == len(groups) - 1) for j, g in enumerate(groups)]
        assert "".join(pieces) == TOK.decode(ids)
        # every prefix the stream has shown is a prefix of the final text, and nothing ends in a split character
        shown = ""
        for p in pieces[:-1]:
            shown += p
            assert TOK.decode(ids).startswith(shown) and not shown.endswith("\ufffd")


@pytest.mark.parametrize("stops", [("STOP",), ("o w", "ün"), ("\u3059", "🎉"), ("e",)])
def test_text_stream_and_stop_checker_match_a_whole_text_search(stops):
    for ids, groups in outputs():
        full = TOK.decode(ids)
        hits = [i for i in (full.find(s) for s in stops) if i >= 0]
        expected = full[:min(hits)] if hits else full
        stream, text = TextStream(TOK, stops), ""
        for j, g in enumerate(groups):
            text += stream.push(g, final=j == len(groups) - 1)
            if stream.stopped:
                break
        assert text == expected and stream.stopped == bool(hits)
        # the engine's checker stops at the first token whose text completes a stop string
        checker = StopChecker(TOK, SamplingParams(stop=stops, max_tokens=10**6), eos_id=-1)
        req, stopped_at = Request("r", [1], SamplingParams()), None
        for t, _ in enumerate(ids):
            req.output_ids.append(ids[t])
            if checker.check(req):
                stopped_at = t
                break
        first = next((t for t in range(len(ids)) if any(s in TOK.decode(ids[:t + 1]) for s in stops)), None)
        assert stopped_at == first


def test_incremental_decoder_is_exact_for_a_decoder_that_strips_the_first_space():
    """SentencePiece-style (Metaspace) decoders drop the leading space of a sequence's first token: decoding a
    window that starts at an unreturned token would lose a space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    words = ["\u2581Hello", "\u2581world", "!", "\u2581and", "\u2581more", "s"]
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!"))
    hf.decoder = decoders.Metaspace()

    class Words:
        def decode(self, ids):
            return hf.decode(ids)

    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(words)) for _ in range(rng.randint(1, 12))]
        dec = IncrementalDecoder(Words())
        pieces, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            pieces.append(dec.push(ids[i:i + k], final=i + k >= len(ids)))
            i += k
        assert "".join(pieces) == hf.decode(ids)
