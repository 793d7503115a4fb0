"""Stop rules for one request: eos, max_tokens and stop strings (on the decoded text)."""

from __future__ import annotations

from model.tokenizer import Tokenizer

from .request import Request
from .sampling import SamplingParams


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, eos_id: int):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer, self.params, self.eos_id = tokenizer, params, eos_id

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
        """Character offset in the decoded output where the first stop string begins, if any."""
        text = self.tokenizer.decode(req.output_ids)
        hits = [text.find(s) for s in self.params.stop if s and s in text]
        return min(hits) if hits else None
