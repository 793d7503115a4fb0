"""The prefill leader: gRPC (grpc.aio) front of the pipeline, request validation, health and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import re
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from proto import prefill_pb2, prefill_pb2_grpc
from transfer.layout import layout_hash, region_layout, transfer_layers

from .config import PrefillConfig
from .driver import Driver, PrefillFailed
from .messages import Job
from .pipeline import Pipeline, follower_main

log = logging.getLogger(__name__)
SESSION = re.compile(r"^[0-9a-fA-F.:\[\]]+:\d+$")


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.tokens = Counter("prefill_tokens", "prompt tokens prefilled", registry=registry)
        self.requests = Counter("prefill_requests", "requests by outcome", ["outcome"], registry=registry)
        self.queue = Gauge("prefill_queue_requests", "requests waiting for a round", registry=registry)
        self.bytes = Counter("prefill_transfer_bytes", "bytes pushed to decode", registry=registry)
        self.transfer_wait = Histogram("prefill_transfer_wait_seconds", "time waiting for writes after compute",
                                       registry=registry)
        self.compute = Histogram("prefill_stage_compute_seconds", "stage compute time per request",
                                 registry=registry)

    def observe(self, job: Job, reports) -> None:
        self.tokens.inc(len(job.token_ids))
        for r in reports:
            self.bytes.inc(r.bytes)
            self.transfer_wait.observe(r.transfer_wait_s)
            self.compute.observe(r.compute_s)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, cfg: PrefillConfig, pipeline: Pipeline, driver: Driver, metrics: Metrics):
        self.cfg, self.pipeline, self.driver, self.metrics = cfg, pipeline, driver, metrics
        self.mcfg = pipeline.worker.mcfg
        self.hash = layout_hash(self.mcfg, pipeline.dtype)
        self.layers = transfer_layers(self.mcfg)

    async def GetInfo(self, request, context):
        stages = [prefill_pb2.StageInfo(stage=i, first_layer=r.start, last_layer=r.stop)
                  for i, r in enumerate(self.pipeline.ranges)]
        return prefill_pb2.InfoReply(model=os.path.abspath(self.cfg.model), layout_hash=self.hash, stages=stages,
                                     cache_dtype=str(self.pipeline.dtype).removeprefix("torch."),
                                     num_layers=self.mcfg.num_hidden_layers,
                                     drafter_layers=self.mcfg.dspark_num_layers, vocab_size=self.mcfg.vocab_size,
                                     max_prompt_tokens=self.cfg.max_prompt_tokens)

    async def Prefill(self, request, context):
        rid = request.request_id or "?"
        try:
            job = self._validate(request)
        except _Refused as e:
            self.metrics.requests.labels(e.code.name.lower()).inc()
            log.info("request %s refused: %s", rid, e)
            await context.abort(e.code, str(e))
        if not await asyncio.to_thread(self.pipeline.worker.engine.alive, job.session):
            self.metrics.requests.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"destination {job.session} does not answer Mooncake "
                                                             f"probes")
        remaining = context.time_remaining()
        if remaining is not None:
            job = dataclasses.replace(job, deadline_unix=time.time() + remaining)
        try:
            out = await self.driver.submit(job, remaining)
        except PrefillFailed as e:
            self.metrics.requests.labels(e.code.lower()).inc()
            await context.abort(getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL), str(e))
        except asyncio.CancelledError:  # the caller went away: make sure nothing is still writing for it
            await self.driver.cancel(job.request_id)
            raise
        self.metrics.requests.labels("ok").inc()
        last = out.reports[-1]
        stages = [prefill_pb2.StageTiming(stage=r.stage, compute_s=r.compute_s, transfer_wait_s=r.transfer_wait_s,
                                          bytes=r.bytes) for r in out.reports]
        log.info("request %s: %d tokens prefilled, %d bytes pushed", rid, len(job.token_ids),
                 sum(r.bytes for r in out.reports))
        return prefill_pb2.PrefillReply(request_id=job.request_id, first_token=last.first_token,
                                        first_logprob=last.first_logprob, bytes_moved=sum(r.bytes for r in out.reports),
                                        stages=stages, queue_s=out.queue_s,
                                        first_top_logprobs=[prefill_pb2.TokenLogprob(token=t, logprob=lp)
                                                            for t, lp in last.first_top])

    async def Cancel(self, request, context):
        found = await self.driver.cancel(request.request_id)
        log.info("request %s: cancel %s", request.request_id, "acknowledged" if found else "of an unknown request")
        return prefill_pb2.CancelReply(found=found)

    def _validate(self, req) -> Job:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if req.layout_hash != self.hash:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"layout hash mismatch: request has {req.layout_hash!r}, this service has {self.hash!r}")
        if not req.request_id:
            raise _Refused(bad, "request_id is empty")
        ids, vocab = list(req.token_ids), self.mcfg.vocab_size
        if not ids:
            raise _Refused(bad, "token_ids is empty")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise _Refused(bad, f"prompt of {len(ids)} tokens exceeds max_prompt_tokens {self.cfg.max_prompt_tokens}")
        out = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if out:
            raise _Refused(bad, f"token id {out[1]} at position {out[0]} is outside the vocabulary (0..{vocab - 1})")
        s = req.sampling
        if s.seed >= 2**63:
            raise _Refused(bad, f"sampling.seed {s.seed} must be below 2**63")
        if s.temperature < 0 or not 0 <= s.top_p <= 1 or not 0 <= s.top_logprobs <= 20:
            raise _Refused(bad, f"sampling: temperature {s.temperature} must be >= 0, top_p {s.top_p} in (0, 1], "
                                f"top_logprobs {s.top_logprobs} in 0..20")
        d = req.destination
        if not SESSION.match(d.session):
            raise _Refused(bad, f"destination.session {d.session!r} is not 'ip:port'")
        regions = {r.layer: r for r in d.regions}
        if sorted(regions) != self.layers or len(d.regions) != len(self.layers):
            raise _Refused(bad, f"destination.regions cover layers {sorted(regions)}, expected {self.layers}")
        for layer, r in regions.items():
            need = region_layout(self.mcfg, layer, len(ids), self.pipeline.dtype).nbytes
            if r.nbytes != need or r.address == 0:
                raise _Refused(bad, f"region for layer {layer} is {r.nbytes} bytes at {r.address:#x}; "
                                    f"the layout needs {need} bytes")
        return Job(req.request_id, tuple(ids), s.temperature, s.top_p or 1.0, s.seed, d.session,
                   {layer: r.address for layer, r in regions.items()}, s.top_logprobs)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


BROKEN_EXIT = 3  # the pipeline broke: the process exits so that a supervisor starts a fresh one


async def _serve_async(cfg: PrefillConfig, pipeline: Pipeline, followers: list) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until the pipeline breaks (returns BROKEN_EXIT): a stage process
    died, or a round failed between stages. A broken pipeline cannot be mended in place (the stages' collectives
    are out of step), so the service stops answering and exits; decode sees the peer go away."""
    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.host, registry=registry)
    stop, broken = asyncio.Event(), []

    def fail(reason: str) -> None:
        if not broken:
            log.critical("prefill pipeline broken: %s; exiting", reason)
            broken.append(reason)
            stop.set()
    driver = Driver(pipeline, cfg.batch_tokens, loop, metrics,
                    on_broken=lambda reason: loop.call_soon_threadsafe(fail, reason))
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(cfg, pipeline, driver, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {cfg.host}:{cfg.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("dspark.prefill.v1.PrefillService", health_pb2.HealthCheckResponse.SERVING)
    print(f"prefill service ready on {cfg.host}:{cfg.port} ({pipeline.world} stage(s))", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def watch_stages():  # a stage dying between rounds (NCCL might otherwise wait in a collective for long)
        while True:
            dead = [p for p in followers if not p.is_alive()]
            if dead:
                fail(f"stage process {dead[0].name} exited with code {dead[0].exitcode}")
                return
            await asyncio.sleep(0.5)
    watcher = loop.create_task(watch_stages())
    await stop.wait()
    watcher.cancel()
    if broken:
        for name in ("", "dspark.prefill.v1.PrefillService"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=0.5)
        return BROKEN_EXIT  # the driver thread may be stuck in a collective: not joined
    log.info("shutting down")
    await server.stop(grace=2)
    await asyncio.to_thread(driver.close)
    return 0


def serve(cfg: PrefillConfig, log_level: str = "INFO") -> int:
    """Run this process's rank: the leader (rank 0) also spawns the local followers unless RANK is set."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", cfg.pp))
    rank = int(env.get("RANK", 0))
    master = (env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", cfg.master_port)))
    if rank != 0:
        follower_main(cfg, rank, world, master, log_level)
        return 0
    followers = []
    if "RANK" not in env:
        ctx = mp.get_context("spawn")
        followers = [ctx.Process(target=follower_main, args=(cfg, r, world, master, log_level), daemon=True)
                     for r in range(1, world)]
        for p in followers:
            p.start()
    env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    pipeline = Pipeline(cfg, 0, world)
    code = asyncio.run(_serve_async(cfg, pipeline, followers))
    if code == BROKEN_EXIT:
        for p in followers:
            p.kill()  # no stage may go on writing into decode's memory
        logging.shutdown()
        os._exit(code)  # threads stuck in collectives would keep an orderly exit waiting
    for p in followers:
        p.join(timeout=10)
    return 0
