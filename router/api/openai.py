"""OpenAI-compatible request bodies and response shapes (completions and chat completions).

No field that changes the output is silently ignored. The fields of OpenAI, vLLM and SGLang that would change
what is generated and are not served yet are refused by name unless they carry their no-op value (`UNSERVED`).
Structured output (`response_format`, vLLM's `structured_outputs` and `guided_*`, SGLang's `regex` /
`json_schema` / `ebnf`) is read by `router/api/structured.py`. A field nobody here knows is kept aside
(`unknown_fields`): the API names it in its log and in the counter `dspark:ignored_request_fields_total`, and
refuses it by name when started with strict fields; the fields known to change nothing (`NO_OP_FIELDS`: `user`,
`metadata`, …) just work. Values we do support are type- and range-checked here, in the types where the OpenAPI
schema can show the bound, and pydantic's errors become OpenAI-shaped 400s in `router/api/errors.py`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from protos.validate import MAX_STOP_STRINGS
from protos.validate import MIN_TEMPERATURE as GREEDY_BELOW
from router.api.structured import StructuredFields
from router.api.tools import FAMILIES, Family, ToolCall, ToolFields, tool_result, written_calls
from services.types import (
    MAX_ALLOWED_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    SamplingParams,
)

MAX_BATCH = 64  # prompts in one completions request, and choices (prompts × samples) in one request
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
    ahead: bool | None = Field(None, description="the drafter drafts the next block while this one is verified "
                               "(null: the deployment's default)")


# Fields of OpenAI, vLLM and SGLang that change the output and are not served yet, with the value that asks for
# nothing (accepted as such; so are null, [] and {}).
UNSERVED = {"use_beam_search": False, "length_penalty": 1.0,  # (a body that declares one of them reads it)
            "suffix": None, "tools": None, "tool_choice": None, "prompt_logprobs": None, "top_n_sigma": -1.0,
            "logits_processors": None, "functions": None, "function_call": None,
            "continue_final_message": False,
            "chat_template": None, "chat_template_kwargs": None, "return_tokens_as_token_ids": False,
            "spaces_between_special_tokens": True,
            # OpenAI's newer chat fields, and vLLM's / SGLang's that shape the prompt, the text or the reply
            "audio": None, "verbosity": None, "web_search_options": None, "reasoning_effort": None,
            "echo": False, "add_generation_prompt": True, "documents": None, "return_token_ids": False,
            "guided_whitespace_pattern": None, "vllm_xargs": None, "no_stop_trim": False,
            "custom_logit_processor": None, "separate_reasoning": False, "stream_reasoning": False,
            "session_params": None}
# Fields that change nothing a model generates (bookkeeping, routing hints, client ids): accepted, not counted.
NO_OP_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "request_id", "priority", "prediction",
                          "modalities", "cache_salt", "kv_transfer_params", "rid",
                          "stream_interval", "lora_path", "return_hidden_states", "custom_params",
                          "prompt_cache_key", "safety_identifier", "guided_decoding_backend", "mm_processor_kwargs",
                          "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank"})


class _Common(_Body, StructuredFields):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**31)  # -1 or 0: off (vLLM uses -1); the tiers carry it as uint32
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_BATCH, description="choices per prompt (samples j use seed + j)")
    ignore_eos: bool = False
    # Logits processors (services/processors.py), applied inside verification: speculative output stays exact.
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0, description="locally typical sampling (Hugging Face's rule)")
    min_tokens: int = Field(0, ge=0, lt=2**31)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ALLOWED_TOKENS)] | None = Field(
        None, description="only these token ids may be generated (vLLM)")
    bad_words: Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS // 2)] | None = Field(
        None, description="words never generated: each one's last token is banned after the rest of it (vLLM)")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None

    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=2**31, description="keep only the prompt's last "
                                               "k tokens (-1: the model's maximum length), as vLLM does")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data):
        if isinstance(data, dict):
            for name, noop in UNSERVED.items():
                if name in data and name not in cls.model_fields and data[name] not in (None, noop, [], {}):
                    raise ValueError(f"{name} is not supported (only {noop!r})")
        return data

    def unknown_fields(self) -> list[str]:
        """Fields of the request that no model here reads and that are not known to change nothing."""
        return sorted(k for k in (self.model_extra or {}) if k not in UNSERVED and k not in NO_OP_FIELDS)

    @model_validator(mode="after")
    def _one_constraint(self):
        self.grammar()  # two structured-output constraints, or a malformed one: refused here, by name
        return self

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

    def samples(self) -> int:
        """Samples generated per prompt (best_of of them, when more than the n returned)."""
        return self.n

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    def sampling(self, max_tokens: int) -> SamplingParams:
        logprobs, prompt_logprobs = self.logprob_counts()
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                              seed=self.seed, max_tokens=max_tokens, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              min_p=self.min_p, typical_p=self.typical_p, min_tokens=self.min_tokens,
                              logit_bias=bias, logprobs=logprobs, allowed_token_ids=tuple(self.allowed_token_ids or ()),
                              prompt_logprobs=prompt_logprobs, grammar=self.grammar())


class CompletionRequest(_Common):
    """`prompt`: a string, token ids, or a batch of either (lm-eval sends a batch of one; choices come back
    indexed per prompt, as OpenAI and vLLM answer)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields kept to be named (`unknown_fields`)
    add_special_tokens: bool = Field(True, description="the model's BOS rule applied to text prompts (vLLM)")

    prompt: (str | list[int] | Annotated[list[str], Field(max_length=MAX_BATCH)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(max_length=MAX_BATCH)]) = Field(
        min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: the prompt's too)")
    best_of: int | None = Field(None, ge=1, le=MAX_BATCH, description="samples per prompt, of which the n with "
                                "the highest cumulative logprob are returned")
    prompt_param: ClassVar[str] = "prompt"  # the field a context-length error names

    @model_validator(mode="after")
    def _best_of_rules(self):  # OpenAI's and vLLM's rules
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.samples() > self.n:
            raise ValueError("best_of cannot be streamed (the choices are known only at the end)")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # ranking best_of samples needs each token's logprob, asked for or not
        ranked = 0 if self.samples() > self.n else None
        return (self.logprobs if self.logprobs is not None else ranked), self.logprobs if self.echo else None

    def samples(self) -> int:
        return self.best_of or self.n

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
    OpenAI's newer name of the system role; an assistant turn may carry the `tool_calls` it made (then its content
    may be null), and a `tool` message's content — a call's result — is given to the model as a user turn, in the
    words of the model's tool-call family (router/api/tools.py)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TokenizedText | Annotated[list[TextPart], Field(min_length=1)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part of type {kind!r} is not supported (only text)")
        return v

    def as_turn(self, family: Family = FAMILIES["json"]) -> dict[str, str]:
        text = (self.content if isinstance(self.content, str) or self.content is None
                else "".join(p.text for p in self.content)) or ""
        if self.tool_calls:
            text += written_calls(self.tool_calls, family)
        if self.role == "tool":
            text = tool_result(text, family)
        role = {"developer": "system", "tool": "user"}.get(self.role, self.role)
        return {"role": role, "content": text}


class ChatCompletionRequest(_Common, ToolFields):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields kept to be named (`unknown_fields`)
    add_special_tokens: Literal[False] = Field(False, description="the chat template writes the special tokens; "
                                               "true (a second BOS, in vLLM) is refused")
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
        if self.tool_mode() not in ("none", "auto") and self.grammar() is not None:
            raise ValueError("tool_choice that forces a call and a structured-output constraint: one of them")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
