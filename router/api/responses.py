"""OpenAI response bodies and stream chunks (completions and chat), one `ResponseShape` per request.

The pydantic models document the 200 bodies in the OpenAPI schema; the bodies themselves are built as dicts
(`ResponseShape`), choice by choice, with logprobs in each endpoint's own shape (`router/api/logprobs.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from router.api.logprobs import LogprobFormat
from router.api.tools import ToolCall, ToolUse
from router.session import Chunk
from services.tokenizer import TextTokenizer
from services.types import TokenLogprobs


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
    content: str | None  # null when the reply is tool calls only
    tool_calls: list[ToolCall] | None = None


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
                 logprobs: bool = False, echo: bool = False, tools: ToolUse | None = None):
        """`logprobs`: the request asks for them; `echo`: completions with the prompt before the output; `tools`:
        a chat reply is read for tool calls (streamed: held back and sent whole with the finish)."""
        self.kind, self.id, self.model, self.tokenizer, self.echo = kind, request_id, model, tokenizer, echo
        self.tools = tools
        self._held: dict[int, Output] = {}  # streamed choices held back to be read for tool calls
        self.fmt = LogprobFormat(tokenizer) if logprobs else None
        self.created = int(time.time())
        self._started: set[int] = set()  # streamed choices that sent their first chunk (role, echo)
        self._offset: dict[int, int] = {}  # characters streamed so far per choice (completions' text_offset)

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
            choices = [{"index": i, "message": {"role": "assistant", **self._reply(out)},
                        "logprobs": None if self.fmt is None else self.fmt.chat(out.token_ids, out.logprobs),
                        "finish_reason": self._finish(out)} for i, out in enumerate(outputs)]
            body = self._envelope("chat.completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def _reply(self, out: Output) -> dict:
        """A chat message's content, and its tool calls when the request offered tools and the reply made some."""
        if self.tools is None:
            return {"content": out.text}
        content, calls = self.tools.parse(out.text)
        return {"content": content, "tool_calls": [c.model_dump() for c in calls]} if calls else {"content": out.text}

    def _finish(self, out: Output) -> str | None:
        if self.tools is not None and out.finish == "stop" and self.tools.parse(out.text)[1]:
            return "tool_calls"
        return out.finish

    def chunk(self, chunk: Chunk, prompt_ids: list[int], index: int = 0) -> dict | None:
        """The stream chunk of choice `index` (its first also carries the role, or the echoed prompt); None while
        a reply that may be a tool call is held back."""
        if self.kind == "chat" and self.tools is not None:
            return self._held_chunk(chunk, prompt_ids, index)
        out = Output(prompt_ids)
        out.add(chunk)
        first = index not in self._started
        self._started.add(index)
        if self.kind == "completion":
            choice = self._completion(index, out, self._offset.get(index, 0), self.echo and first)
            self._offset[index] = self._offset.get(index, 0) + len(choice["text"])
            return self._envelope("text_completion", [choice])
        delta: dict = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
        logprobs = None if self.fmt is None else self.fmt.chat(out.token_ids, out.logprobs)
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                         "finish_reason": out.finish}])

    def _held_chunk(self, chunk: Chunk, prompt_ids: list[int], index: int) -> dict | None:
        """With tools, a choice's reply is read whole: one delta at its finish (OpenAI's shape: the role, the
        content or the calls with their index, id, type and function), which the openai SDK assembles."""
        out = self._held.setdefault(index, Output(prompt_ids))
        out.add(chunk)
        if out.finish is None:
            return None
        reply = self._reply(out)
        delta: dict = {"role": "assistant", "content": reply["content"]}
        if "tool_calls" in reply:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(reply["tool_calls"])]
        logprobs = None if self.fmt is None else self.fmt.chat(out.token_ids, out.logprobs)
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                         "finish_reason": self._finish(out)}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
