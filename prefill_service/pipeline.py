"""The stage processes and the rounds that drive them.

Every stage runs the same loop: receive a `Round` from the leader (rank 0), run each job through its layers
(activations from the previous stage, to the next stage), then send its reports to the leader. Jobs are
micro-batches: while stage s works on job i+1, stage s+1 works on job i. torch.distributed carries everything:
gloo on CPU, NCCL on GPU; rendezvous through MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.devices import resolve_device
from model.config import load_config

from .config import PrefillConfig, split_layers
from .messages import Round, StageReport
from .stage import StageWorker

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(self, cfg: PrefillConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) // world))
        device, dtype = resolve_device(cfg.device, cfg.dtype)
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        self.device, self.dtype = device, dtype
        mcfg = load_config(cfg.model)
        self.ranges = split_layers(mcfg.num_hidden_layers, world, tuple(mcfg.dspark_target_layer_ids))
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    timeout=timedelta(minutes=30))
        self.worker = StageWorker(cfg, rank, world, self.ranges[rank], device, dtype)
        self._sends: list = []
        if world > 1:
            self._warm_up()

    def _warm_up(self) -> None:
        """One empty round's worth of traffic before the service reports ready: NCCL creates its communicators
        lazily (one for the collectives, another for each neighbour pair's send/recv), which would otherwise land
        on the first request."""
        self._broadcast(Round())
        if self.rank > 0:
            self._recv(1)
        if self.rank < self.world - 1:
            self._send(torch.zeros(1, 1, *self.worker.hidden_shape, dtype=self.dtype, device=self.device))
        for h in self._sends:
            h.wait()
        self._sends.clear()

    # ---- neighbour exchange ----------------------------------------------------------------------
    def _recv(self, k: int) -> torch.Tensor:
        t = torch.empty(1, k, *self.worker.hidden_shape, dtype=self.dtype, device=self.device)
        dist.recv(t, src=self.rank - 1)
        return t

    def _send(self, streams: torch.Tensor) -> None:
        self._sends.append(dist.isend(streams.contiguous(), dst=self.rank + 1))

    # ---- rounds ----------------------------------------------------------------------------------
    def _broadcast(self, rnd: Round | None) -> Round:
        if self.world == 1:
            return rnd
        box = [rnd]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def _run(self, rnd: Round, on_report: Callable[[int, StageReport], None] | None = None) -> list[StageReport]:
        reports = []
        for i, job in enumerate(rnd.jobs):
            reports.append(self.worker.run(job, self._recv, self._send))
            if on_report is not None:
                on_report(i, reports[-1])
        for h in self._sends:
            h.wait()
        self._sends.clear()
        return reports

    def lead(self, rnd: Round, on_job: Callable[[int, list[StageReport]], None] | None = None
             ) -> list[list[StageReport]]:
        """Leader: run a round on every stage; returns the reports per job, one per stage.

        With one stage, on_job(i, reports) is called as each job finishes, so its reply need not wait for the rest
        of the round; with several, the last stage's reports reach the leader only at the round's end."""
        self._broadcast(rnd)
        if self.world == 1:
            early = (lambda i, report: on_job(i, [report])) if on_job is not None else None
            return [[r] for r in self._run(rnd, early)]
        mine = self._run(rnd)
        gathered = [None] * self.world
        dist.gather_object(mine, gathered, dst=0)
        return [list(per_job) for per_job in zip(*gathered)]

    def follow(self) -> None:
        """Non-leader stages: serve rounds until the leader says shutdown."""
        while True:
            rnd = self._broadcast(None)
            if rnd.shutdown:
                break
            dist.gather_object(self._run(rnd), None, dst=0)
        dist.destroy_process_group()

    def shutdown(self) -> None:
        if self.world > 1:
            self._broadcast(Round(shutdown=True))
            dist.destroy_process_group()


def follower_main(cfg: PrefillConfig, rank: int, world: int, master: tuple[str, int], log_level: str) -> None:
    """Entry point of a spawned stage process."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s stage{rank} %(name)s: %(message)s")
    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    Pipeline(cfg, rank, world).follow()
