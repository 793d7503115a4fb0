"""OpenAI-compatible request bodies (pydantic): what the service accepts, with ranges checked field by field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, presence_penalty, ...) are ignored

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI clients send null for "not set" (temperature, n, stream, ...): take the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class ContentPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def limit(self) -> int:
        return self.max_tokens

    @property
    def alternatives(self) -> int | None:
        return self.logprobs
