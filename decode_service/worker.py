"""The engine thread: the only place model code runs on the decode side. The event loop talks to it through a
command queue (install a prefilled request, abort one); outputs come back on per-request asyncio queues."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.request import StepOutput
from engine.sampling import SamplingParams

from .kv_receiver import KVReceiver, Reservation

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Install:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first: tuple[int, float, list]
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


class Failed(Exception):
    """Sent to a request's queue when the engine could not take it."""


class EngineWorker:
    def __init__(self, engine: Engine, receiver: KVReceiver, loop: asyncio.AbstractEventLoop, metrics=None,
                 threads: int = 0):
        self.engine, self.receiver, self.loop, self.metrics = engine, receiver, loop, metrics
        self._commands: queue.Queue = queue.Queue()
        self._outputs: dict[str, asyncio.Queue] = {}
        self._live: dict[str, object] = {}  # request id -> engine Request (engine thread only)
        self._threads = threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- event loop side ---------------------------------------------------------------------------
    def open(self, request_id: str) -> asyncio.Queue:
        q = asyncio.Queue()
        self._outputs[request_id] = q
        return q

    def install(self, cmd: Install) -> None:
        self._commands.put(cmd)

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    def close(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return len(self._live)

    # ---- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        if self.engine.runner.device.type == "cuda":
            torch.cuda.set_device(self.engine.runner.device)  # this thread's launches go to the engine's GPU
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                try:
                    outs = self.engine.step()
                except Exception:  # noqa: BLE001 - fail the running requests, keep serving
                    log.exception("engine step failed; aborting the running requests")
                    for rid in list(self._live):
                        self._fail(rid, "engine step failed")
                    continue
                for out in outs:
                    self._emit(out)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None

    def _apply(self, cmd) -> None:
        if isinstance(cmd, Abort):
            req = self._live.pop(cmd.request_id, None)
            if req is not None and req.finish_reason is None:
                self.engine.abort(req)
                log.info("request %s aborted", cmd.request_id)
            return
        res = cmd.reservation
        try:
            req, out = self.engine.install(cmd.prompt_ids, cmd.params, cmd.first,
                                           lambda pool, slot, tables: self.receiver.unpack(res, pool, slot, tables),
                                           request_id=cmd.request_id)
        except Exception as e:  # noqa: BLE001 - e.g. out of cache: this request fails, others go on
            log.exception("request %s could not be installed", cmd.request_id)
            self._put(cmd.request_id, Failed(str(e)))
            return
        finally:
            self.receiver.release(res, safe=True)  # prefill completed: nothing writes any more
        if not out.finished:
            self._live[cmd.request_id] = req
        self._emit(out)

    def _emit(self, out: StepOutput) -> None:
        if out.finished:
            req = self._live.pop(out.request_id, None)
            if self.metrics and req is not None and req.steps:
                self.metrics.finished(req)
        self._put(out.request_id, out)

    def _fail(self, rid: str, why: str) -> None:
        req = self._live.pop(rid, None)
        if req is not None and req.finish_reason is None:
            self.engine.abort(req)
        self._put(rid, Failed(why))

    def _put(self, rid: str, item) -> None:
        def put():
            q = self._outputs.get(rid)
            if q is not None:
                q.put_nowait(item)
        self.loop.call_soon_threadsafe(put)
