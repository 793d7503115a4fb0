"""Admission control: at most `max_running` requests (and `cache_tokens` worst-case tokens) hold cache at once;
up to `max_queued` more wait in FIFO order; beyond that a request is refused at once (HTTP 429 + Retry-After)."""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    pass


class Admission:
    def __init__(self, max_running: int, max_queued: int, cache_tokens: int):
        self.max_running, self.max_queued, self.cache_tokens = max_running, max_queued, cache_tokens
        self.running, self.tokens = 0, 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, tokens: int) -> bool:
        return self.running < self.max_running and self.tokens + tokens <= self.cache_tokens

    async def acquire(self, tokens: int) -> int:
        if tokens > self.cache_tokens:
            raise ValueError(f"request needs {tokens} tokens of cache, the service has {self.cache_tokens}")
        if not self._waiters and self._fits(tokens):
            self._take(tokens)
            return tokens
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(f"{self.running} requests running and {len(self._waiters)} queued")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((tokens, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(tokens)  # admitted just as the caller left
            elif (tokens, fut) in self._waiters:
                self._waiters.remove((tokens, fut))
            raise
        return tokens

    def _take(self, tokens: int) -> None:
        self.running += 1
        self.tokens += tokens

    def release(self, tokens: int) -> None:
        self.running -= 1
        self.tokens -= tokens
        while self._waiters and self._fits(self._waiters[0][0]):
            t, fut = self._waiters.popleft()
            if fut.done():  # its caller left (cancelled) before we got here
                continue
            self._take(t)
            fut.set_result(None)
