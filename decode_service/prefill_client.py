"""The decode service's side of gRPC: prefill peers, readiness (GetInfo with a matching layout hash), the choice
of peer (least outstanding prefill tokens), Prefill calls with deadlines and Cancel."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from proto import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class LayoutMismatch(RuntimeError):
    pass


class PrefillUnavailable(RuntimeError):
    """A prefill could not be done; `safe` tells whether the peer can still write into the regions."""

    def __init__(self, message: str, safe: bool):
        super().__init__(message)
        self.safe = safe


@dataclass
class Peer:
    address: str
    stub: prefill_pb2_grpc.PrefillServiceStub
    channel: grpc.aio.Channel
    ready: bool = False
    outstanding_tokens: int = 0
    info: prefill_pb2.InfoReply | None = None


class PrefillPeers:
    def __init__(self, addresses: list[str], layout_hash: str):
        self.layout_hash = layout_hash
        self._background: set[asyncio.Task] = set()
        self.peers = []
        for a in addresses:
            ch = grpc.aio.insecure_channel(a)
            self.peers.append(Peer(a, prefill_pb2_grpc.PrefillServiceStub(ch), ch))

    @property
    def ready(self) -> bool:
        return any(p.ready for p in self.peers)

    @property
    def max_prompt_tokens(self) -> int | None:
        """The smallest prompt limit the ready peers announced (None before any answered)."""
        limits = [p.info.max_prompt_tokens for p in self.peers if p.ready and p.info is not None]
        return min(limits) if limits else None

    async def check(self, timeout_s: float = 2.0) -> None:
        """Refresh readiness; raises LayoutMismatch if a peer runs another model or layout."""
        for p in self.peers:
            try:
                info = await p.stub.GetInfo(prefill_pb2.InfoRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                if p.ready:
                    log.warning("prefill peer %s stopped answering: %s", p.address, e.code().name)
                p.ready = False
                continue
            if info.layout_hash != self.layout_hash:
                raise LayoutMismatch(f"prefill peer {p.address} has layout hash {info.layout_hash!r}, this decode "
                                     f"service has {self.layout_hash!r} (different model, dtype or version)")
            if not p.ready:
                log.info("prefill peer %s ready (%d stage(s), model %s)", p.address, len(info.stages), info.model)
            p.ready, p.info = True, info

    def _pick(self) -> Peer:
        ready = [p for p in self.peers if p.ready] or self.peers
        return min(ready, key=lambda p: p.outstanding_tokens)

    async def prefill(self, request: prefill_pb2.PrefillRequest, timeout_s: float, on_abandon
                      ) -> prefill_pb2.PrefillReply:
        """on_abandon(safe) is called if the caller is cancelled mid-call, once the peer acknowledged the cancel
        (safe=True) or could not be reached (safe=False)."""
        peer = self._pick()
        n = len(request.token_ids)
        peer.outstanding_tokens += n
        try:
            return await peer.stub.Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE and not e.details().startswith(("destination", "request")):
                peer.ready = False  # the peer itself is unreachable (not our own Mooncake endpoint)
            # refused before any work started: nothing can write. Otherwise only an answered Cancel proves it (the
            # service remembers cancelled ids, so a late Prefill is refused too); without one, quarantine
            safe = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            if not safe:
                safe = await self.cancel(peer, request.request_id)
            raise PrefillUnavailable(f"prefill on {peer.address} failed: {code.name}: {e.details()}", safe) from e
        except asyncio.CancelledError:
            # the caller left. This task may be cancelled again and again (anyio), so the cancel runs in a task of
            # its own and the callback releases the regions when the peer has answered.
            task = asyncio.get_running_loop().create_task(self.cancel(peer, request.request_id))
            task.add_done_callback(lambda t: on_abandon(not t.cancelled() and t.exception() is None and t.result()))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        finally:
            peer.outstanding_tokens -= n

    async def cancel(self, peer: Peer, request_id: str) -> bool:
        """True once the peer acknowledged that nothing writes for the request any more."""
        try:
            await peer.stub.Cancel(prefill_pb2.CancelRequest(request_id=request_id), timeout=30)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        for p in self.peers:
            await p.channel.close()
