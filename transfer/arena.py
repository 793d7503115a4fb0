"""The decode side's receive arena: one registered buffer, pre-touched at startup, carved into per-request slices.

Reuse rule: a released slice goes to quarantine and becomes free again only when no write can still land in it —
the caller says `safe` (prefill reported completion, or a cancel was acknowledged by every stage), or the slice's
deadline plus a margin has passed. Mooncake only refuses writes outside registered memory, so a late write into a
reused slice would corrupt another request.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass

import torch

ALIGN = 4096


class ArenaFull(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Slice:
    offset: int
    nbytes: int


class Arena:
    def __init__(self, nbytes: int, device: str | torch.device = "cpu", late_write_margin_s: float = 5.0):
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # zeros: pages touched now
        self.margin = late_write_margin_s
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)
        self._quarantine: dict[int, tuple[Slice, float]] = {}  # offset -> (slice, reuse-after monotonic time)
        self._lock = threading.Lock()

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def view(self, s: Slice) -> torch.Tensor:
        return self.buffer[s.offset:s.offset + s.nbytes]

    def allocate(self, nbytes: int) -> Slice:
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._expire()
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                    return Slice(off, size)
        raise ArenaFull(f"receive arena has no free range of {size} bytes ({self.free_bytes} free in total)")

    def release(self, s: Slice, safe: bool, deadline: float | None = None) -> None:
        """safe: no write can land any more; otherwise quarantine until `deadline` (monotonic) + margin."""
        with self._lock:
            if safe:
                self._insert(s)
            else:
                self._quarantine[s.offset] = (s, (deadline or time.monotonic()) + self.margin)

    def settle(self, s: Slice) -> None:
        """A quarantined slice became safe early (e.g. a late cancel acknowledgement)."""
        with self._lock:
            if self._quarantine.pop(s.offset, None) is not None:
                self._insert(s)

    def _expire(self) -> None:
        now = time.monotonic()
        for off, (s, t) in list(self._quarantine.items()):
            if t <= now:
                del self._quarantine[off]
                self._insert(s)

    def _insert(self, s: Slice) -> None:
        i = bisect.bisect(self._free, (s.offset, s.nbytes))
        self._free.insert(i, (s.offset, s.nbytes))
        merged = []
        for off, n in self._free:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)
