"""Host-side bookkeeping of cache memory: which slot and which blocks each request owns.

Pure Python (no tensors): the scheduler asks it whether a request fits and grows requests block by block.
Slot 0 and block 0 are scratch and never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class OutOfCache(RuntimeError):
    pass


@dataclass(slots=True)
class RequestCache:
    slot: int
    tokens: int = 0  # tokens whose state is committed
    tables: dict[int, list[int]] = field(default_factory=dict)  # ratio -> block ids


def blocks_for(tokens: int, ratio: int, block_size: int) -> int:
    """Blocks holding the compressed entries of `tokens` tokens at compression `ratio` (whole windows only)."""
    return -(-(tokens // ratio) // block_size)


class CacheAllocator:
    def __init__(self, num_slots: int, num_blocks: dict[int, int], block_size: int):
        self.block_size = block_size
        self.free_slots = list(range(num_slots - 1, 0, -1))
        self.free_blocks = {r: list(range(n - 1, 0, -1)) for r, n in num_blocks.items()}
        self.capacity = {r: n - 1 for r, n in num_blocks.items()}

    def _blocks_for(self, tokens: int, ratio: int) -> int:
        return blocks_for(tokens, ratio, self.block_size)

    def can_fit(self, tokens: int) -> bool:
        """Could a new request holding `tokens` tokens be admitted now?"""
        return bool(self.free_slots) and all(
            self._blocks_for(tokens, r) <= len(free) for r, free in self.free_blocks.items())

    def admit(self) -> RequestCache:
        if not self.free_slots:
            raise OutOfCache("no free cache slot")
        return RequestCache(slot=self.free_slots.pop(), tables={r: [] for r in self.free_blocks})

    def reserve(self, rc: RequestCache, tokens: int) -> None:
        """Make sure rc's tables cover `tokens` tokens; all or nothing."""
        need = {r: self._blocks_for(tokens, r) - len(rc.tables[r]) for r in self.free_blocks}
        short = {r: n for r, n in need.items() if n > len(self.free_blocks[r])}
        if short:
            raise OutOfCache(f"cache blocks exhausted (ratio -> blocks short: {short})")
        for r, n in need.items():
            for _ in range(max(n, 0)):
                rc.tables[r].append(self.free_blocks[r].pop())

    def release(self, rc: RequestCache) -> None:
        for r, blocks in rc.tables.items():
            self.free_blocks[r].extend(reversed(blocks))
            blocks.clear()
        if rc.slot:
            self.free_slots.append(rc.slot)
            rc.slot = 0

    @property
    def free_slot_count(self) -> int:
        return len(self.free_slots)
