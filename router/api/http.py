"""The OpenAI-compatible HTTP API over a `Router` (FastAPI + uvicorn + sse-starlette).

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health (503 when a
tier is down), /metrics (Prometheus), /version. Errors are OpenAI-shaped (`router/api/errors.py`): 400 for
bad input, 401 for a missing or wrong API key, 413 for a body over the cap, 429 with Retry-After when
full. Streaming sends one SSE chunk per cycle, then `[DONE]`; errors after the 200 arrive as a data chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from router.api.choices import MergedFeed, best
from router.api.errors import ApiError, documented, error_response, install_error_handlers, known_error
from router.api.http_admission import HttpAdmission
from router.api.openai import ChatCompletionRequest, CompletionRequest
from router.api.responses import ChatCompletionResponse, CompletionResponse, ModelList, Output, ResponseShape
from router.api.stream import ChunkFeed
from router.api.vllm_compat import ROUTES as VLLM_ROUTES
from router.api.vllm_compat import add_routes as add_vllm_routes
from router.router import Router
from router.session import Chunk, RouterRequest
from services.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
VERSION = "0.1.0"
GUARDED = ("/v1", *VLLM_ROUTES)  # /health, /metrics and /version stay open for probes and scrapers
# `stream: true`: one event per cycle; OpenAPI 3.1 has the schema of an event stream describe each event.
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {
        "type": "string", "description": "a JSON chunk, a JSON error object after a failure, or [DONE] last"}}}}}


@dataclass(frozen=True, slots=True)
class ApiConfig:
    model: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20  # the largest request body read; larger ones get 413 unread
    # SSE keep-alive comments every this many seconds (0: none). Off by default: several benchmark clients
    # (SGLang's bench_serving, vLLM's older benchmark_serving, llmperf) parse a `: ping` comment as JSON.
    keepalive_s: float = 0.0
    strict_fields: bool = False  # an unknown request field: 400 naming it (else logged and counted)


async def _read_capped(receive, cap: int, declared: str | None) -> list[dict] | None:
    """The request's body messages, or None once they pass `cap` bytes (at once if Content-Length says so)."""
    if declared is not None and declared.isdecimal() and int(declared) > cap:
        return None
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # the client left: the app sees the disconnect
            return messages
        size += len(message.get("body", b""))
        if size > cap:
            return None
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()  # then disconnects, which SSE listens for
    return replayed


class Gatekeeper:
    """Pure ASGI middleware (BaseHTTPMiddleware would feed SSE a spurious disconnect): checks
    `Authorization: Bearer KEY` on /v1 by SHA-256 digest and constant-time compare, reads the body up to
    the cap (FastAPI would buffer it anyway), and echoes or assigns `X-Request-Id` (also the root of our
    internal request id) on every response, errors included."""

    def __init__(self, app, digests: list[bytes], max_body_bytes: int):
        self.app, self.digests, self.max_body_bytes = app, digests, max_body_bytes

    def _authorized(self, scope, headers: dict[str, str]) -> bool:
        if not self.digests or not scope["path"].startswith(GUARDED) or scope["method"] == "OPTIONS":
            return True
        header = headers.get("authorization", "")
        given = hashlib.sha256(header.removeprefix("Bearer ").encode("latin-1")).digest()  # the bytes as sent
        return header.startswith("Bearer ") and any([secrets.compare_digest(given, d) for d in self.digests])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if not self._authorized(scope, headers):
            return await error_response(401, "Unauthorized", code="invalid_api_key")(scope, receive, send_with_id)
        body = await _read_capped(receive, self.max_body_bytes, headers.get("content-length"))
        if body is None:
            return await error_response(413, f"request body exceeds {self.max_body_bytes} bytes",
                                        code="request_too_large")(scope, receive, send_with_id)
        await self.app(scope, _replay(body, receive), send_with_id)


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    tiers: dict[str, bool]


async def _prepend(firsts: list[Chunk], rest: AsyncIterator[tuple[int, Chunk]]
                   ) -> AsyncIterator[tuple[int, Chunk]]:
    for index, chunk in enumerate(firsts):
        yield index, chunk
    async for item in rest:
        yield item


def build_app(router: Router, tokenizer: TextTokenizer, config: ApiConfig,
              health: Callable[[], Awaitable[dict[str, bool]]], tracer: trace.Tracer | None = None) -> FastAPI:
    app = FastAPI(title="dspark", version=VERSION)
    tracer = tracer or trace.NoOpTracer()
    digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
    app.add_middleware(Gatekeeper, digests=digests, max_body_bytes=config.max_body_bytes)
    install_error_handlers(app)
    add_vllm_routes(app, router, tokenizer, config.model, config.max_model_len)
    admit = HttpAdmission(router, tokenizer, config.model, config.max_model_len)

    async def respond(body: CompletionRequest | ChatCompletionRequest, request: Request, kind: str):
        unknown = body.unknown_fields()
        if unknown and config.strict_fields:
            raise ApiError(400, f"unknown field {unknown[0]!r} (this server refuses fields it does not know)",
                           unknown[0], "unknown_field")
        for name in unknown:  # not silent: an operator sees what clients send that no model reads
            log.warning("request %s: field %r is not known here and was ignored", request.state.request_id, name)
            router.metrics.ignored_fields.labels(config.model, name).inc()
        groups = admit(body, request.state.request_id)  # per prompt, its samples
        reqs = [r for group in groups for r in group]
        shape = ResponseShape(kind, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request.state.request_id}",
                              config.model, tokenizer, body.wants_logprobs(),
                              isinstance(body, CompletionRequest) and body.echo, admit.tool_use(body))
        op = "text_completion" if kind == "completion" else "chat"
        span = tracer.start_span(f"{op} {config.model}", attributes={
            "gen_ai.operation.name": op, "gen_ai.request.model": config.model, "gen_ai.request.stream": body.stream,
            "dspark.http_request_id": request.state.request_id, "gen_ai.request.choice.count": len(reqs)})
        prompt_tokens = sum(len(group[0].prompt_ids) for group in groups)
        if body.stream:
            with trace.use_span(span):  # the feeds' tasks inherit the span as their parent
                feed = MergedFeed([ChunkFeed(router.generate(r)) for r in reqs])
            try:
                firsts = await feed.firsts()  # refused before a first token: a status code, not a 200
            except Exception:
                span.end()
                raise
            return EventSourceResponse(_stream(reqs, shape, body, span, feed, firsts, prompt_tokens),
                                       ping=config.keepalive_s, sep="\n")
        with trace.use_span(span, end_on_exit=True):  # errors go to http_errors' handlers
            outputs = await collect_all(reqs)
            chosen = []  # prompt-major: each prompt's n choices (best_of: the n best of its samples)
            for i, group in enumerate(groups):
                mine = outputs[i * len(group) : (i + 1) * len(group)]
                chosen += best(mine, body.n) if len(group) > body.n else mine
            return shape.full(chosen, prompt_tokens, sum(len(o.token_ids) for o in outputs))

    async def collect_all(reqs: list[RouterRequest]) -> list[Output]:
        """Side by side; the first failure cancels the rest and is what the client gets."""
        if len(reqs) == 1:
            return [await collect(reqs[0])]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(collect(r)) for r in reqs]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [t.result() for t in tasks]

    async def collect(req: RouterRequest) -> Output:
        """A request's whole text, finish reason and tokens (and logprobs)."""
        out = Output(req.prompt_ids)
        async with contextlib.aclosing(router.generate(req)) as chunks:
            async for chunk in chunks:
                out.add(chunk)
        return out

    async def _stream(reqs: list[RouterRequest], shape: ResponseShape, body, span, feed: MergedFeed,
                      firsts: list[Chunk], prompt_tokens: int):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        completion = [0] * len(reqs)
        with trace.use_span(span, end_on_exit=True):
            try:
                async for index, chunk in _prepend(firsts, feed.rest()):
                    completion[index] = chunk.completion_tokens
                    # a chunk of tokens whose text is held back still carries their logprobs
                    if chunk.text or chunk.finish_reason is not None or (shape.fmt and chunk.token_ids):
                        piece = shape.chunk(chunk, reqs[index].prompt_ids, index)
                        if piece is not None:  # None: held back (a reply read whole for tool calls)
                            yield json.dumps(piece)
            except Exception as error:
                status, error_chunk = known_error(error)
                if status == 500:
                    log.exception("request %s failed", reqs[0].request_id)
                yield json.dumps(error_chunk)
                return
            finally:
                await feed.close()  # the client left midway: stop generating, free the tiers
            if include_usage:
                yield json.dumps(shape.usage_chunk(prompt_tokens, sum(completion)))
            yield "[DONE]"

    generation_errors = documented(400, 401, 413, 429, 503)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": SSE}, **generation_errors})
    async def completions(body: CompletionRequest, request: Request):
        return await respond(body, request, "completion")

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse, "content": SSE}, **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(body, request, "chat")

    @app.get("/v1/models", responses={200: {"model": ModelList}, **documented(401)})
    async def models():
        card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "dspark",
                "root": config.model, "parent": None, "max_model_len": config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health", responses={200: {"model": Health}, 503: {"model": Health, "description": "a tier is down"}})
    async def healthz():
        tiers = await health()
        return JSONResponse({"status": "ok" if all(tiers.values()) else "unavailable", "tiers": tiers},
                            200 if all(tiers.values()) else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    return app
