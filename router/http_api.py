"""The OpenAI-compatible HTTP API over a `Router` (FastAPI + uvicorn + sse-starlette).

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health (503 when a
tier is down), /metrics (Prometheus), /version. Errors are OpenAI-shaped: 400 for bad input (pydantic
validation included, never 422), 401 for a missing or wrong API key, 429 with Retry-After when full.
Streaming sends one SSE chunk per cycle, then `[DONE]`; errors after the 200 arrive as a data chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse

from router.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponseShape
from router.router import Router
from router.session import RouterRequest
from services.data.chat_format import render
from services.errors import CapacityError, InvalidRequestError, TierUnavailableError
from services.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
VERSION = "0.1.0"
GUARDED = ("/v1",)  # /health, /metrics and /version stay open for probes and scrapers


@dataclass(frozen=True, slots=True)
class ApiConfig:
    model: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(error: Exception) -> JSONResponse:
    if isinstance(error, ApiError):
        return JSONResponse(error_body(error.message, error.type, error.param, error.code), error.status)
    if isinstance(error, InvalidRequestError):
        return JSONResponse(error_body(str(error), "BadRequestError", code="invalid_request"), 400)
    if isinstance(error, CapacityError):
        return JSONResponse(error_body(str(error), "RateLimitError", code="overloaded"), 429, {"Retry-After": "1"})
    if isinstance(error, TierUnavailableError):
        return JSONResponse(error_body(str(error), "ServiceUnavailableError"), 503, {"Retry-After": "1"})
    return JSONResponse(error_body(f"internal error ({type(error).__name__})", "InternalServerError"), 500)


class AuthAndRequestId:
    """Pure ASGI middleware (BaseHTTPMiddleware would feed SSE a spurious disconnect): checks
    `Authorization: Bearer KEY` on /v1 by SHA-256 digest and constant-time compare, and echoes or assigns
    `X-Request-Id` (also the root of our internal request id)."""

    def __init__(self, app, digests: list[bytes]):
        self.app, self.digests = app, digests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.digests and scope["path"].startswith(GUARDED) and scope["method"] != "OPTIONS":
            header = headers.get("authorization", "")
            given = hashlib.sha256(header.removeprefix("Bearer ").encode()).digest()
            if not header.startswith("Bearer ") or not any([secrets.compare_digest(given, d) for d in self.digests]):
                response = JSONResponse(error_body("Unauthorized", "AuthenticationError", code="invalid_api_key"), 401)
                return await response(scope, receive, send)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(router: Router, tokenizer: TextTokenizer, config: ApiConfig,
              health: Callable[[], Awaitable[dict[str, bool]]], tracer: trace.Tracer | None = None) -> FastAPI:
    app = FastAPI(title="dspark", version=VERSION)
    tracer = tracer or trace.NoOpTracer()
    digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]

    app.add_middleware(AuthAndRequestId, digests=digests)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
                            for e in exc.errors())
        return JSONResponse(error_body(message, "BadRequestError", param, "invalid_request"), 400)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        return _error_response(exc)

    def prepare(body: CompletionRequest | ChatCompletionRequest, request: Request) -> RouterRequest:
        if body.model != config.model:
            raise ApiError(400, f"model {body.model!r} does not exist; this server serves {config.model!r}",
                           "BadRequestError", "model", "model_not_found")
        if isinstance(body, ChatCompletionRequest):
            prompt_ids = tokenizer.encode(render([m.model_dump() for m in body.messages], add_generation_prompt=True))
            wanted = body.max_completion_tokens or body.max_tokens
        elif isinstance(body.prompt, str):
            prompt_ids, wanted = tokenizer.encode(body.prompt), body.max_tokens
        else:
            prompt_ids, wanted = list(body.prompt), body.max_tokens
            if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
                raise ApiError(400, f"prompt token ids must lie in [0, {tokenizer.vocab_size})", "BadRequestError",
                               "prompt", "invalid_request")
        room = config.max_model_len - len(prompt_ids)
        max_tokens = wanted or room
        if max_tokens > room:
            raise ApiError(400, f"this model's maximum context length is {config.max_model_len} tokens; the request "
                           f"has {len(prompt_ids)} prompt tokens and asks for {max_tokens} more", "BadRequestError",
                           "max_tokens", "context_length_exceeded")
        stops = () if body.ignore_eos else tuple(tokenizer.eos_token_ids)
        spec = body.speculative.model_dump(exclude_none=True) if body.speculative else None
        rid = f"{request.state.request_id}-{uuid.uuid4().hex[:8]}"  # unique even if a client reuses its id
        req = RouterRequest(prompt_ids=prompt_ids, params=body.sampling(max_tokens), request_id=rid,
                            stop=tuple(body.stop or ()), stop_token_ids=(*stops, *(body.stop_token_ids or ())),
                            speculative=spec)
        router.speculation(spec)  # 400 now for options this deployment does not serve
        router.check_capacity()
        return req

    async def respond(body, request: Request, kind: str):
        req = prepare(body, request)
        shape = ResponseShape(kind, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request.state.request_id}",
                              config.model)
        op = "text_completion" if kind == "completion" else "chat"
        span = tracer.start_span(f"{op} {config.model}", attributes={
            "gen_ai.operation.name": op, "gen_ai.request.model": config.model, "gen_ai.request.stream": body.stream,
            "dspark.http_request_id": request.state.request_id})
        if body.stream:
            return EventSourceResponse(_stream(req, shape, body, span), ping=15, sep="\n")
        try:
            with trace.use_span(span, end_on_exit=True):
                text, finish, completion = [], None, 0
                async with contextlib.aclosing(router.generate(req)) as chunks:
                    async for chunk in chunks:
                        text.append(chunk.text)
                        finish, completion = chunk.finish_reason or finish, chunk.completion_tokens
                return shape.full("".join(text), str(finish), len(req.prompt_ids), completion)
        except Exception as error:
            return _error_response(error)

    async def _stream(req: RouterRequest, shape: ResponseShape, body, span):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        completion = 0
        with trace.use_span(span, end_on_exit=True):
            try:
                async with contextlib.aclosing(router.generate(req)) as chunks:
                    async for chunk in chunks:
                        completion = chunk.completion_tokens
                        if chunk.text or chunk.finish_reason is not None:
                            yield json.dumps(shape.chunk(chunk))
            except (InvalidRequestError, CapacityError, TierUnavailableError) as error:
                yield json.dumps(error_body(str(error), type(error).__name__))
                return
            except Exception as error:
                log.exception("request %s failed", req.request_id)
                yield json.dumps(error_body(f"internal error ({type(error).__name__})", "InternalServerError"))
                return
            if include_usage:
                yield json.dumps(shape.usage_chunk(len(req.prompt_ids), completion))
            yield "[DONE]"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(body, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(body, request, "chat")

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "dspark",
                "max_model_len": config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def healthz():
        tiers = await health()
        return JSONResponse({"status": "ok" if all(tiers.values()) else "unavailable", "tiers": tiers},
                            200 if all(tiers.values()) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    return app
