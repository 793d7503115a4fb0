"""One pipeline stage: its contiguous layers of the target (the last stage also the context-KV-only drafter and the
head), a scratch cache pool for the request being prefilled, and a Mooncake engine that pushes each finished layer's
packed state to the destination while the next layer computes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

import model
from engine.allocator import CacheAllocator
from engine.batch import make_batch
from engine.sampling import TARGET, probs_from_logits, sample_from_probs
from model.cache import CachePool, ratios_of
from model.checkpoint import load_drafter
from transfer.layout import region_layout
from transfer.mooncake import MooncakeEngine, TransferError, Write
from transfer.pack import pack_layer

from .config import PrefillConfig
from .messages import Job, StageReport

log = logging.getLogger(__name__)
BLOCK = 64


class StageWorker:
    def __init__(self, cfg: PrefillConfig, stage: int, stages: int, layers: range, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.stage, self.device, self.dtype = cfg, stage, device, dtype
        self.last = stage == stages - 1
        self.model = model.load(cfg.model, device=device, dtype=dtype, layers=layers, qat_sim=cfg.qat_sim)
        self.mcfg = self.model.cfg
        self.drafter = None
        if self.last and self.mcfg.has_dspark:
            self.drafter = load_drafter(cfg.model, device=device, dtype=dtype, context_only=True,
                                        qat_sim=cfg.qat_sim)
        self.layers = list(layers) + (self.drafter.layer_ids if self.drafter else [])
        self.ratios = ratios_of(self.mcfg, layers)
        blocks = {r: cfg.max_prompt_tokens // r // BLOCK + 2 for r in self.ratios}
        self.pool = CachePool(self.mcfg, self.layers, 2, blocks, BLOCK, device, dtype)
        self.alloc = CacheAllocator(2, blocks, BLOCK)
        self.engine = MooncakeEngine(cfg.host, cfg.protocol, cfg.device_names)
        staging = sum(region_layout(self.mcfg, i, cfg.max_prompt_tokens, dtype).nbytes for i in self.layers)
        self.staging = torch.zeros(staging, dtype=torch.uint8, device=device)
        self.engine.register(self.staging)
        log.info("stage %d: layers %s%s on %s, staging %.1f MiB, mooncake %s", stage, layers,
                 " + drafter context" if self.drafter else "", device, staging / 2**20, self.engine.session)

    @property
    def hidden_shape(self) -> tuple[int, int]:
        return self.mcfg.hc_mult, self.mcfg.hidden_size

    def run(self, job: Job, recv: Callable[[int], torch.Tensor], send: Callable[[torch.Tensor], None]
            ) -> StageReport:
        """Prefill one job through this stage's layers; recv(k)/send(streams) talk to the neighbour stages."""
        rep = StageReport(self.stage, job.request_id)
        rc = self.alloc.admit()
        t0 = time.perf_counter()
        ids, n = list(job.token_ids), len(job.token_ids)
        shipper = _Shipper(self, job, rc, n, rep)
        try:
            self.alloc.reserve(rc, n)
            self.pool.clear_slot(rc.slot)
            chunk = self.cfg.chunk_tokens
            for c0 in range(0, n, chunk):
                self._chunk(job, rc, ids[c0:c0 + chunk], c0 + chunk >= n, shipper, recv, send)
            rep.compute_s = time.perf_counter() - t0
        finally:
            shipper.finish()  # whatever happened, wait for the writes already started
            self.alloc.release(rc)
        return rep

    def _chunk(self, job, rc, part, final, shipper, recv, send) -> None:
        """One chunk through this stage. The neighbour exchange always happens, even after an error (then with
        zeros), so one failed request never leaves the pipe out of step."""
        streams = None if self.model.has_embed else recv(len(part))
        out_streams = None
        if shipper.rep.error is None:
            try:
                out_streams = self._compute(job, rc, part, final, shipper, streams)
            except Exception as e:  # noqa: BLE001 - reported for this request; the service goes on
                log.exception("request %s: stage %d failed", job.request_id, self.stage)
                shipper.rep.error = f"INTERNAL: stage {self.stage}: {e}"
        if not self.last:
            if out_streams is None:
                out_streams = torch.zeros(1, len(part), *self.hidden_shape, dtype=self.dtype, device=self.device)
            send(out_streams)

    def _compute(self, job, rc, part, final, shipper, streams):
        batch = make_batch([(rc, part)], self.ratios, self.device, block_size=BLOCK)
        out = self.model.extend(batch, self.pool, streams, capture=self._aux(), on_layer=shipper.on_layer(batch, final))
        rc.tokens += len(part)
        if self.last:
            self._context(batch, out.aux, final, shipper)
            if final:
                self._first_token(job, out.streams[:, -1], shipper.rep)
        return out.streams

    def _aux(self) -> tuple[int, ...]:
        return tuple(self.mcfg.dspark_target_layer_ids) if self.drafter is not None else ()

    @torch.inference_mode()
    def _context(self, batch, aux, final: bool, shipper: "_Shipper") -> None:
        if self.drafter is None:
            return
        k = torch.tensor([batch.input_ids.shape[1]], device=self.device)
        for layer, rows in zip(self.drafter.layer_ids, self.drafter(aux, batch.positions)):
            self.pool.commit_rows(layer, batch, rows, k)
            if final:
                shipper.ship(layer)

    @torch.inference_mode()
    def _first_token(self, job: Job, streams: torch.Tensor, rep: StageReport) -> None:
        logits = self.model.logits(streams)  # [1, V]
        dev = logits.device
        probs = probs_from_logits(logits, torch.tensor([job.temperature], device=dev),
                                  torch.tensor([job.top_p], device=dev))
        tok = sample_from_probs(probs, torch.tensor([job.seed], device=dev),
                                torch.tensor([len(job.token_ids)], device=dev), TARGET)
        logp = torch.log_softmax(logits, -1)[0]
        rep.first_token = int(tok)
        rep.first_logprob = float(logp[tok])
        if job.top_logprobs:
            top = logp.topk(job.top_logprobs)
            rep.first_top = list(zip(top.indices.tolist(), top.values.tolist()))


class _Shipper:
    """Commits each finished layer and, on the final chunk, packs it into staging and starts its write.

    A transfer failure is recorded in the report and stops further shipping, but never the compute: every stage
    keeps exchanging activations with its neighbours, so the pipe stays in step for the next job."""

    def __init__(self, worker: StageWorker, job: Job, rc, tokens: int, rep: StageReport):
        self.w, self.job, self.rc, self.tokens, self.rep = worker, job, rc, tokens, rep
        self.offset, self.batches, self.writes = 0, [], []

    def on_layer(self, batch, final: bool):
        k = torch.tensor([batch.input_ids.shape[1]], device=self.w.device)

        def hook(layer, pending):
            self.w.pool.commit(batch, {layer: pending}, k)
            if final:
                self.ship(layer)
        return hook

    def ship(self, layer: int) -> None:
        if self.rep.error is not None:
            return
        try:
            self._ship(layer)
        except TransferError as e:
            self.rep.error = f"UNAVAILABLE: {e}"

    def _past_deadline(self) -> bool:
        if self.job.deadline_unix and time.time() > self.job.deadline_unix:
            self.rep.error = f"DEADLINE_EXCEEDED: request {self.job.request_id} passed its deadline; writes stopped"
            return True
        return False

    def _ship(self, layer: int) -> None:
        if self._past_deadline():
            return  # the caller may already reuse its regions: nothing may land there any more
        w = self.w
        layout = region_layout(w.mcfg, layer, self.tokens, w.dtype)
        region = w.staging[self.offset:self.offset + layout.nbytes]
        table = self.rc.tables.get(w.mcfg.ratio(layer) if layer < w.mcfg.num_hidden_layers else 0, [])
        pack_layer(w.pool, layout, self.rc.slot, table, region)
        if region.is_cuda:
            torch.cuda.current_stream(region.device).synchronize()  # the engine reads staging directly
        write = Write(region.data_ptr(), self.job.regions[layer], layout.nbytes)
        self.writes.append(write)
        self.batches += w.engine.submit(self.job.session, [write])
        self.offset += -(-layout.nbytes // 64) * 64
        self.rep.bytes += layout.nbytes

    def finish(self) -> None:
        """Wait for this job's writes; if they failed but the peer still answers probes, write everything once
        more (staging still holds the packed layers) before giving up."""
        t = time.perf_counter()
        try:
            if self.rep.error is None:
                self._wait_or_retry()
            else:
                self.w.engine.wait(self.job.session, self.batches)
        except TransferError as e:
            self.rep.error = self.rep.error or f"UNAVAILABLE: {e}"
        finally:
            self.rep.transfer_wait_s = time.perf_counter() - t

    def _wait_or_retry(self) -> None:
        engine, peer = self.w.engine, self.job.session
        try:
            engine.wait(peer, self.batches)
        except TransferError as first:
            if not engine.alive(peer) or self._past_deadline():
                raise
            log.warning("request %s: retrying %d write(s) after %s", self.job.request_id, len(self.writes), first)
            engine.wait(peer, engine.submit(peer, self.writes))
