"""OpenAI-compatible request bodies and response shapes (completions and chat completions).

Unknown fields are accepted and ignored, as vLLM does (clients send vendor extras), except the sampling
fields of OpenAI and vLLM that would change what is generated: those are refused by name unless they
carry their no-op value (`UNSERVED`), never silently ignored. Values we do support are type- and
range-checked here, in the types where the OpenAPI schema can show the bound, and pydantic's errors become
OpenAI-shaped 400s in `http_errors.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from protos.validate import MAX_STOP_STRINGS
from protos.validate import MIN_TEMPERATURE as GREEDY_BELOW
from router.api.logprobs import LogprobFormat
from router.session import Chunk
from services.tokenizer import TextTokenizer
from services.types import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams, TokenLogprobs

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
UNSERVED = {"best_of": 1, "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
            "suffix": None, "response_format": None, "tools": None, "tool_choice": None, "guided_json": None,
            "guided_regex": None, "guided_choice": None, "guided_grammar": None, "prompt_logprobs": None}


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
    # Logits processors (services/processors.py), applied inside verification: speculative output stays exact.
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, lt=2**31)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    include_stop_str_in_output: bool = False
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

    @field_validator("logit_bias")
    @classmethod
    def _bias_token_ids(cls, v):
        if v is not None and not all(k.isdecimal() and int(k) < 2**31 for k in v):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per output token, per prompt token); None = not asked for."""
        return None, None

    def sampling(self, max_tokens: int) -> SamplingParams:
        logprobs, prompt_logprobs = self.logprob_counts()
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                              seed=self.seed, max_tokens=max_tokens, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              min_p=self.min_p, min_tokens=self.min_tokens, logit_bias=bias, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)


class CompletionRequest(_Common):
    """`prompt`: a string, token ids, or a batch of either (lm-eval sends a batch of one; choices come back
    indexed per prompt, as OpenAI and vLLM answer)."""

    prompt: (str | list[int] | Annotated[list[str], Field(max_length=MAX_BATCH)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(max_length=MAX_BATCH)]) = Field(
        min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: the prompt's too)")
    prompt_param: ClassVar[str] = "prompt"  # the field a context-length error names

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_param: ClassVar[str] = "messages"

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
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


@dataclass(slots=True)
class Output:
    """One choice, collected: its text, finish reason and tokens (with their logprobs when asked for)."""

    prompt_ids: list[int]
    text: str = ""
    finish: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.finish = str(chunk.finish_reason) if chunk.finish_reason is not None else self.finish
        self.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs or TokenLogprobs()
            self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs = chunk.prompt_logprobs or self.prompt_logprobs


class ResponseShape:
    """Builds the response and stream-chunk bodies of one request (completion or chat)."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str, tokenizer: TextTokenizer,
                 logprobs: bool = False, echo: bool = False):
        """`logprobs`: the request asks for them; `echo`: completions with the prompt before the output."""
        self.kind, self.id, self.model, self.tokenizer, self.echo = kind, request_id, model, tokenizer, echo
        self.fmt = LogprobFormat(tokenizer) if logprobs else None
        self.created = int(time.time())
        self.sent_role = False
        self._offset = 0  # characters streamed so far (completions' text_offset)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _completion(self, index: int, out: Output, offset: int, with_prompt: bool) -> dict:
        prompt_text = self.tokenizer.decode(out.prompt_ids) if with_prompt else ""
        logprobs = None
        if self.fmt is not None:
            prompt = (out.prompt_ids, out.prompt_logprobs) if with_prompt else None
            logprobs = self.fmt.completion(out.token_ids, out.logprobs, offset, prompt)
        return {"index": index, "text": prompt_text + out.text, "logprobs": logprobs, "finish_reason": out.finish}

    def full(self, outputs: list[Output], prompt_tokens: int, completion_tokens: int) -> dict:
        """One choice per output, indexed in order."""
        if self.kind == "completion":
            choices = [self._completion(i, out, 0, self.echo) for i, out in enumerate(outputs)]
            body = self._envelope("text_completion", choices)
        else:
            choices = [{"index": i, "message": {"role": "assistant", "content": out.text},
                        "logprobs": None if self.fmt is None else self.fmt.chat(out.token_ids, out.logprobs),
                        "finish_reason": out.finish} for i, out in enumerate(outputs)]
            body = self._envelope("chat.completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, chunk: Chunk, prompt_ids: list[int]) -> dict:
        out = Output(prompt_ids)
        out.add(chunk)
        if self.kind == "completion":
            first = not self.sent_role
            self.sent_role = True
            choice = self._completion(0, out, self._offset, self.echo and first)
            self._offset += len(choice["text"])
            return self._envelope("text_completion", [choice])
        delta: dict = {"content": chunk.text}
        if not self.sent_role:
            delta, self.sent_role = {"role": "assistant", **delta}, True
        logprobs = None if self.fmt is None else self.fmt.chat(out.token_ids, out.logprobs)
        return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                         "finish_reason": out.finish}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
