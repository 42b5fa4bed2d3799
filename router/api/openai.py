"""OpenAI-compatible request bodies and response shapes (completions and chat completions).

Unknown fields are accepted and ignored, as vLLM does (clients send vendor extras), except the sampling
fields of OpenAI and vLLM that would change what is generated: those are refused by name unless they
carry their no-op value (`UNSERVED`), never silently ignored. Values we do support are type- and
range-checked here, in the types where the OpenAPI schema can show the bound, and pydantic's errors become
OpenAI-shaped 400s in `http_errors.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from protos.validate import MAX_STOP_STRINGS
from protos.validate import MIN_TEMPERATURE as GREEDY_BELOW
from router.session import Chunk
from services.types import SamplingParams

MAX_BATCH = 64  # prompts in one completions request
MAX_STOP_CHARS = 256  # each cycle matches every prefix of every stop string: quadratic in its length
MAX_STOP_TOKEN_IDS = 64  # below the gRPC cap (protos.validate, 256): the HTTP API publishes 64 (docs/security.md)


def _encodable(text: str) -> str:
    # JSON escapes can carry lone surrogates, which the tokenizer cannot take and UTF-8 cannot encode.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


TokenizedText = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Body(BaseModel):
    """Strict types, as OpenAI's API: "8" is not an integer nor true a 1, so the schema says what is accepted."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SpeculativeOptions(_Body):
    """Per-request speculation, within what the deployment serves."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    policy: str | None = None
    gamma: int | None = Field(None, ge=1)
    min_tokens_per_s: float | None = Field(None, ge=0.0, le=1e6, description="SLA: raise this request's verify "
                                           "length until its expected speed reaches this (policy dspark)")


# Sampling fields of OpenAI / vLLM not served yet, with the value that asks for nothing (accepted as such).
UNSERVED = {"min_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "min_p": 0.0, "best_of": 1, "logit_bias": None, "include_stop_str_in_output": False,
            "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0, "echo": False,
            "suffix": None, "response_format": None, "tools": None, "tool_choice": None, "guided_json": None,
            "guided_regex": None, "guided_choice": None, "guided_grammar": None}


class _Common(_Body):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**31)  # -1 or 0: off (vLLM uses -1); the tiers carry it as uint32
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    ignore_eos: bool = False
    logprobs: bool | int | None = Field(None, description="not served: null or false")  # chat: bool, else int
    speculative: SpeculativeOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data):
        if isinstance(data, dict):
            for name, noop in UNSERVED.items():
                if name in data and data[name] is not None and data[name] != noop and data[name] != {}:
                    raise ValueError(f"{name} is not supported (only {noop!r})")
        return data

    @field_validator("temperature")
    @classmethod
    def _greedy_when_tiny(cls, v):
        # The tiers refuse 0 < T < MIN_TEMPERATURE (logits / T overflows fp32); here it means greedy, as in vLLM.
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None and v is not False:  # identity: 0 == False, but logprobs=0 asks for the sampled token's
            raise ValueError("logprobs are not supported")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                              seed=self.seed, max_tokens=max_tokens)


class CompletionRequest(_Common):
    """`prompt`: a string, token ids, or a batch of either (lm-eval sends a batch of one; choices come back
    indexed per prompt, as OpenAI and vLLM answer)."""

    prompt: (str | list[int] | Annotated[list[str], Field(max_length=MAX_BATCH)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(max_length=MAX_BATCH)]) = Field(
        min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    prompt_param: ClassVar[str] = "prompt"  # the field a context-length error names

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, v):
        # checked here, not in the union's str member, whose error location would spell out the validator
        if isinstance(v, str):
            return _encodable(v)
        return [_encodable(p) if isinstance(p, str) else p for p in v] if v and not isinstance(v[0], int) else v

    def prompts(self) -> list[str | list[int]]:
        batch = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]

    def wanted_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(_Body):
    type: Literal["text"]
    text: TokenizedText


class ChatMessage(_Body):
    """`content` as a string or as text parts (what vLLM's chat benchmark and guidellm send); `developer` is
    OpenAI's newer name of the system role; a `tool` message's content is given to the model as a user turn."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TokenizedText | Annotated[list[TextPart], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part of type {kind!r} is not supported (only text)")
        return v

    def as_turn(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        role = {"developer": "system", "tool": "user"}.get(self.role, self.role)
        return {"role": role, "content": text}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=0, description="not served: null or 0")
    prompt_param: ClassVar[str] = "messages"

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """The documented 200 body (built as a dict by `ResponseShape`); `stream: true` answers SSE chunks instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(CompletionResponse):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # vLLM's client reads it
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


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

    def full(self, outputs: list[tuple[str, str | None]], prompt_tokens: int, completion_tokens: int) -> dict:
        """One choice per (text, finish reason), indexed in order."""
        if self.kind == "completion":
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                       for i, (text, finish) in enumerate(outputs)]
            body = self._envelope("text_completion", choices)
        else:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish} for i, (text, finish) in enumerate(outputs)]
            body = self._envelope("chat.completion", choices)
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
