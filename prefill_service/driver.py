"""The leader's driver: a thread that forms rounds from queued requests (FIFO, up to a token budget) and runs them
through the pipeline; asyncio futures carry the outcomes back to the gRPC handlers. Model code never runs on the
event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .messages import Job, Round, StageReport
from .pipeline import Pipeline

log = logging.getLogger(__name__)


class PrefillFailed(Exception):
    """code: a grpc.StatusCode name (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Outcome:
    job: Job
    reports: list[StageReport]
    queue_s: float


@dataclass
class _Pending:
    job: Job
    deadline: float | None  # monotonic
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False


class Driver:
    def __init__(self, pipeline: Pipeline, batch_tokens: int, loop: asyncio.AbstractEventLoop, metrics=None,
                 on_broken: Callable[[str], None] | None = None):
        """on_broken(reason) is called (from the driver thread) when a round fails outside a stage's per-request
        containment with several stages: the stages are then out of step, and the driver stops taking work."""
        self.pipeline, self.batch_tokens, self.loop, self.metrics = pipeline, batch_tokens, loop, metrics
        self.on_broken, self.broken = on_broken, None
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[str, _Pending] = {}
        self._round_done: list[asyncio.Future] = []  # cancel acks waiting for the current round
        self._tombstones: deque[str] = deque(maxlen=4096)  # cancelled before they arrived: refused if they do
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="prefill-driver", daemon=True)
        self._thread.start()

    # ---- called on the event loop ----------------------------------------------------------------
    def submit(self, job: Job, timeout_s: float | None) -> asyncio.Future:
        fut = self.loop.create_future()
        with self._cv:
            if self.broken:
                raise PrefillFailed("UNAVAILABLE", f"the prefill pipeline is broken ({self.broken}); restarting")
            if job.request_id in self._inflight or any(p.job.request_id == job.request_id for p in self._queue):
                raise ValueError(f"request {job.request_id} is already being prefilled")
            if job.request_id in self._tombstones:
                raise PrefillFailed("CANCELLED", f"request {job.request_id} was cancelled before it arrived")
            deadline = time.monotonic() + timeout_s if timeout_s is not None else None
            self._queue.append(_Pending(job, deadline, fut))
            self._gauge()
            self._cv.notify()
        return fut

    async def cancel(self, request_id: str) -> bool:
        """True if the request was known; returns once no stage can write for it any more."""
        with self._cv:
            for p in self._queue:
                if p.job.request_id == request_id:
                    self._queue.remove(p)
                    self._gauge()
                    self._resolve(p.future, PrefillFailed("CANCELLED", f"request {request_id} was cancelled"))
                    return True
            p = self._inflight.get(request_id)
            if p is None:
                self._tombstones.append(request_id)  # a Prefill still on its way is refused when it arrives
                return False
            p.cancelled = True
            ack = self.loop.create_future()
            self._round_done.append(ack)
        await ack  # the round ends only after every stage waited for its writes
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()
        if not self.broken:
            self.pipeline.shutdown()

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ---- the driver thread -----------------------------------------------------------------------
    def _take(self) -> list[_Pending]:
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            taken, tokens, now = [], 0, time.monotonic()
            while self._queue and (not taken or tokens + len(self._queue[0].job.token_ids) <= self.batch_tokens):
                p = self._queue.popleft()
                if p.deadline is not None and p.deadline <= now:
                    self._resolve(p.future, PrefillFailed("DEADLINE_EXCEEDED",
                                                          f"request {p.job.request_id}: deadline passed in queue"))
                    continue
                taken.append(p)
                tokens += len(p.job.token_ids)
            self._inflight = {p.job.request_id: p for p in taken}
            self._gauge()
            return taken

    def _loop(self) -> None:
        while True:
            taken = self._take()
            if self._stop:
                break
            if not taken:
                continue
            finished: set[int] = set()

            def on_job(i: int, reports: list[StageReport]) -> None:  # a job done before its round (one stage)
                self._finish(taken[i], reports)
                finished.add(i)  # only once answered: if _finish raised, the round's failure answers it
            try:
                per_job = self.pipeline.lead(Round(tuple(p.job for p in taken)), on_job)
                for i, (p, reports) in enumerate(zip(taken, per_job)):
                    if i not in finished:
                        self._finish(p, reports)
            except Exception as e:  # noqa: BLE001 - a failed round fails its requests
                log.exception("round of %d request(s) failed", len(taken))
                broken = self.pipeline.world > 1  # a collective failed: the stages are out of step for good
                code = "UNAVAILABLE" if broken else "INTERNAL"
                for i, p in enumerate(taken):
                    if i not in finished:
                        self._resolve(p.future, PrefillFailed(code, f"prefill failed: {e}"))
                if broken:
                    self._break(f"{type(e).__name__}: {e}")
            with self._cv:
                self._inflight = {}
                acks, self._round_done = self._round_done, []
            if self.broken:  # a stage may still be writing: cancels get no acknowledgement (decode quarantines)
                for ack in acks:
                    self._resolve(ack, PrefillFailed("UNAVAILABLE", f"the prefill pipeline is broken ({self.broken})"))
                return
            for ack in acks:
                self._resolve(ack, True)

    def _break(self, reason: str) -> None:
        with self._cv:
            self.broken = reason
            queued, self._queue = list(self._queue), deque()
            self._gauge()
        if self.on_broken:  # first: the server stops answering before the queued requests learn why
            self.on_broken(reason)
        for p in queued:
            self._resolve(p.future, PrefillFailed("UNAVAILABLE", f"the prefill pipeline is broken ({reason})"))

    def _finish(self, p: _Pending, reports: list[StageReport]) -> None:
        rid = p.job.request_id
        errors = [r.error for r in reports if r.error]
        if p.cancelled:
            self._resolve(p.future, PrefillFailed("CANCELLED", f"request {rid} was cancelled"))
        elif errors:
            code, _, msg = errors[0].partition(": ")
            log.warning("request %s failed: %s", rid, errors[0])
            self._resolve(p.future, PrefillFailed(code, f"request {rid}: {msg}"))
        elif p.deadline is not None and time.monotonic() > p.deadline:
            self._resolve(p.future, PrefillFailed("DEADLINE_EXCEEDED", f"request {rid}: deadline passed"))
        else:
            if self.metrics:
                self.metrics.observe(p.job, reports)
            self._resolve(p.future, Outcome(p.job, reports, time.monotonic() - p.enqueued))

    def _resolve(self, fut: asyncio.Future, value) -> None:
        def set_():
            if fut.done():
                return
            if isinstance(value, Exception):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        self.loop.call_soon_threadsafe(set_)

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue.set(len(self._queue))
