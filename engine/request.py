"""A generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .allocator import RequestCache
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each output token under the target
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when params.logprobs asks
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    cache: RequestCache | None = None
    drafted: int = 0  # speculative: draft tokens proposed
    accepted: int = 0  # speculative: draft tokens accepted
    steps: int = 0  # decode steps this request took part in

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.all_ids[-1]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
