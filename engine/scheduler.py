"""Which requests run next: pure Python, no tensors.

Waiting requests are admitted (first come, first served) while cache capacity lasts; the running ones decode
together. Admission reserves a request's worst case (prompt + max_tokens + lookahead): compressed entries are
small (1/4 and 1/128 of the tokens), and no running request ever has to be preempted for lack of blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .allocator import CacheAllocator
from .request import Request, Status


@dataclass(frozen=True, slots=True)
class Schedule:
    prefill: list[Request]  # admitted this step: prefill before decoding
    decode: list[Request]  # already running


class Scheduler:
    def __init__(self, alloc: CacheAllocator, max_running: int, lookahead: int):
        """lookahead: tokens a decode step may add per request (1, or the speculative block + 1)."""
        self.alloc, self.max_running, self.lookahead = alloc, max_running, lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit_now(self, req: Request) -> None:
        """Admit a request whose state arrives from elsewhere (a prefill service): it joins the running set."""
        worst = len(req.prompt_ids) + req.params.max_tokens + self.lookahead
        req.cache = self.alloc.admit()
        try:
            self.alloc.reserve(req.cache, worst)
        except Exception:
            self.alloc.release(req.cache)
            req.cache = None
            raise
        req.status = Status.RUNNING
        self.running.append(req)

    def schedule(self) -> Schedule:
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting[0]
            worst = len(req.prompt_ids) + req.params.max_tokens + self.lookahead
            if not self.alloc.can_fit(worst):
                break
            self.waiting.popleft()
            req.cache = self.alloc.admit()
            self.alloc.reserve(req.cache, worst)
            req.status = Status.RUNNING
            admitted.append(req)
        decode = list(self.running)
        self.running.extend(admitted)
        return Schedule(prefill=admitted, decode=decode)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.cache is not None:
            self.alloc.release(req.cache)
            req.cache = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
