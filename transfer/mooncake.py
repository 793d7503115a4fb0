"""The Mooncake Transfer Engine, wrapped: P2P handshake (no metadata server), return codes become exceptions that
name the call, the code and the peer; large writes are split into bounded batches; a failed write is retried once
after a probe shows the peer alive."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma", "nvlink_intra")
MAX_CHUNK = 64 << 20  # bytes per transfer entry
MAX_ENTRIES = 256  # entries per batch


class TransferError(RuntimeError):
    """A Mooncake call failed; `code` is its return value, `peer` the remote session (if any)."""

    def __init__(self, call: str, code: int, peer: str | None = None):
        at = f" to {peer}" if peer else ""
        super().__init__(f"Mooncake {call}{at} failed with code {code}")
        self.call, self.code, self.peer = call, code, peer


@dataclass(frozen=True, slots=True)
class Write:
    src: int  # local address
    dst: int  # remote address
    nbytes: int


class MooncakeEngine:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_names: str = ""):
        if protocol not in PROTOCOLS:
            raise ValueError(f"Mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # e.g. libibverbs.so.1 missing, or the package itself
            raise TransferError(f"import ({e}); install mooncake-transfer-engine and libibverbs1", -1) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise TransferError(f"initialize(host={host}, protocol={protocol})", rc)
        self.host, self.protocol = host, protocol
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def register(self, t: torch.Tensor) -> None:
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        rc = self._engine.register_memory(ptr, n)
        if rc != 0:
            raise TransferError(f"register_memory({n} bytes on {t.device})", rc)
        self._registered[ptr] = n

    def unregister(self, t: torch.Tensor) -> None:
        if self._registered.pop(t.data_ptr(), None) is not None:
            rc = self._engine.unregister_memory(t.data_ptr())
            if rc != 0:
                raise TransferError("unregister_memory", rc)

    def submit(self, peer: str, writes: list[Write]) -> list[int]:
        """Start writes (split into bounded batches); returns batch ids for `wait`."""
        entries = [Write(w.src + o, w.dst + o, min(MAX_CHUNK, w.nbytes - o))
                   for w in writes for o in range(0, w.nbytes, MAX_CHUNK)]
        ids = []
        for i in range(0, len(entries), MAX_ENTRIES):
            part = entries[i:i + MAX_ENTRIES]
            bid = self._engine.batch_transfer_async_write(peer, [e.src for e in part], [e.dst for e in part],
                                                          [e.nbytes for e in part])
            if bid <= 0:
                raise TransferError(f"batch_transfer_async_write({len(part)} entries)", bid, peer)
            ids.append(bid)
        return ids

    def wait(self, peer: str, batch_ids: list[int]) -> None:
        """Block until the batches finish; raise if any failed."""
        if batch_ids:
            rc = self._engine.get_batch_transfer_status(batch_ids)
            if rc != 0:
                raise TransferError(f"transfer of {len(batch_ids)} batch(es)", rc, peer)

    def write(self, peer: str, writes: list[Write]) -> None:
        """Synchronous write with one retry after a successful probe."""
        try:
            self.wait(peer, self.submit(peer, writes))
        except TransferError as first:
            if not self.alive(peer):
                raise
            log.warning("retrying after %s (peer %s answers probes)", first, peer)
            self.wait(peer, self.submit(peer, writes))

    def alive(self, peer: str) -> bool:
        return self._engine.send_probe(peer) == 0
