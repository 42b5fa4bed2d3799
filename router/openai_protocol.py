"""OpenAI-compatible request bodies and response shapes (completions and chat completions).

Unknown fields are accepted and ignored, as vLLM does (clients send vendor extras); values we do
support are range-checked here, and pydantic's errors become OpenAI-shaped 400s in `http_api.py`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.session import Chunk
from services.types import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """Per-request speculation, within what the deployment serves."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    policy: str | None = None
    gamma: int | None = Field(None, ge=1)
    min_tokens_per_s: float | None = Field(None, ge=0.0, le=1e6, description="SLA: raise this request's verify "
                                           "length until its expected speed reaches this (policy dspark)")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off (vLLM uses -1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    logprobs: Literal[False, None] | int = None
    speculative: SpeculativeOptions | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                              seed=self.seed, max_tokens=max_tokens)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseShape:
    """Builds the response and stream-chunk bodies of one request (completion or chat)."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str):
        self.kind, self.id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.sent_role = False

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion", [choice])
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            body = self._envelope("chat.completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, chunk: Chunk) -> dict:
        finish = None if chunk.finish_reason is None else str(chunk.finish_reason)
        if self.kind == "completion":
            return self._envelope("text_completion", [{"index": 0, "text": chunk.text, "logprobs": None,
                                                       "finish_reason": finish}])
        delta: dict = {"content": chunk.text}
        if not self.sent_role:
            delta, self.sent_role = {"role": "assistant", **delta}, True
        return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
