"""What the leader broadcasts to every stage each round, and what each stage reports back (inside the service)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Job:
    request_id: str
    token_ids: tuple[int, ...]
    temperature: float
    top_p: float
    seed: int
    session: str  # the receiver's Mooncake session
    regions: dict[int, int]  # layer -> destination address
    top_logprobs: int = 0
    deadline_unix: float = 0.0  # no write starts after this wall-clock time (0: none)


@dataclass(frozen=True, slots=True)
class Round:
    jobs: tuple[Job, ...] = ()
    shutdown: bool = False


@dataclass(slots=True)
class StageReport:
    """One stage's outcome for one job."""

    stage: int
    request_id: str
    compute_s: float = 0.0
    transfer_wait_s: float = 0.0
    bytes: int = 0
    error: str | None = None  # a transfer failure (the peer) or a compute failure
    first_token: int | None = None  # last stage only
    first_logprob: float | None = None
    first_top: list[tuple[int, float]] = field(default_factory=list)
