"""Stop rules for one request: eos, max_tokens and stop strings (on the decoded text)."""

from __future__ import annotations

from model.tokenizer import IncrementalDecoder, Tokenizer

from .request import Request
from .sampling import SamplingParams


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, eos_id: int):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer, self.params, self.eos_id = tokenizer, params, eos_id
        self._decoder = IncrementalDecoder(tokenizer) if params.stop else None
        self._text = ""  # the output's text up to the decoder's last clean point
        self._longest = max((len(s) for s in params.stop), default=0)

    def check(self, req: Request) -> str | None:
        """Called after each appended token; returns the finish reason or None."""
        if not self.params.ignore_eos and req.output_ids[-1] == self.eos_id:
            return "stop"
        if self.params.stop and self.stop_offset(req) is not None:
            return "stop"
        if len(req.output_ids) >= self.params.max_tokens:
            return "length"
        return None

    def stop_offset(self, req: Request) -> int | None:
        """Character offset in the decoded output where the first stop string begins, if any. Decodes only the
        tokens appended since the last call (plus any held-back partial character) and searches only where a stop
        string could now end."""
        dec = self._decoder
        before = len(self._text)
        self._text += dec.push(req.output_ids[len(dec.ids):])
        start = max(0, before - self._longest + 1)
        hay = self._text[start:] + dec.pending
        hits = [i for i in (hay.find(s) for s in self.params.stop if s) if i >= 0]
        return start + min(hits) if hits else None
