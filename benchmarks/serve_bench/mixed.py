"""The soak's request mix, and one request of it sent and checked.

A request is completions or chat, streamed or not, greedy or sampled (T = 1, seeded), short or long, with one of
the bench arms as its `speculative` option; a few are clients that hang up mid-stream, and a few are deliberately
bad (they must get an OpenAI-shaped 400). Every request ends as one `RequestRecord` whose `error` is empty when the
server behaved, else one of:
  unexpected_status  a status other than 200 (400 for a bad request);
  transport          the connection failed or timed out;
  stream_error       an error event or no `[DONE]` in a 200 stream, or a body that is not the API's JSON;
  wrong_finish       a finish reason that contradicts the request: not stop/length, more tokens than max_tokens,
                     `length` short of max_tokens, or `stop` for an ignore_eos request.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.serve_bench.client import ARMS, speculative

ERROR_KINDS = ("unexpected_status", "transport", "stream_error", "wrong_finish")


@dataclass(frozen=True, slots=True)
class Mix:
    """Shares of each request property, drawn independently per request."""

    model: str = "dspark-target"
    short_tokens: int = 16
    long_tokens: int = 128
    long_share: float = 0.25
    chat_share: float = 0.5
    stream_share: float = 0.5
    sampled_share: float = 0.5
    ignore_eos_share: float = 0.25
    disconnect_share: float = 0.05  # of all requests: streamed, closed after 1-2 content chunks
    bad_share: float = 0.05
    arms: tuple[str, ...] = tuple(ARMS)
    gamma: int = 7


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str  # completion | chat | bad
    stream: bool = False
    temperature: float = 0.0
    max_tokens: int = 16
    arm: str = "none"
    ignore_eos: bool = False
    disconnect_after: int = 0  # content chunks read before hanging up (0: read to the end)
    bad: str = ""  # which bad request


@dataclass(slots=True)
class RequestRecord:
    shape: Shape
    sent_at_s: float  # since the run started
    status: int = 0
    error: str = ""  # "" or one of ERROR_KINDS
    detail: str = ""
    ttft_s: float | None = None  # streamed requests only
    e2el_s: float | None = None
    output_tokens: int = 0
    finish: str | None = None
    disconnected: bool = False
    chunks: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        """A generation that ran to its end as expected (not a bad request, not a hang-up)."""
        return not self.error and self.shape.kind != "bad" and not self.disconnected


def bad_requests(model: str) -> dict[str, tuple[str, dict | bytes]]:
    """name → (path, body) of requests the API must refuse with 400 before any tier sees them."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return {
        "unknown_model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        "temperature": ("/v1/completions", {"model": model, "prompt": "x", "temperature": 5}),
        "context_length": ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 100_000}),
        "unknown_method": ("/v1/chat/completions", {**chat, "speculative": {"method": "medusa"}}),
        "no_messages": ("/v1/chat/completions", {**chat, "messages": []}),
        "malformed_json": ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
    }


def draw(rng: random.Random, mix: Mix) -> Shape:
    u = rng.random()
    if u < mix.bad_share:
        return Shape("bad", bad=rng.choice(sorted(bad_requests(mix.model))))
    hang_up = u < mix.bad_share + mix.disconnect_share
    return Shape("chat" if rng.random() < mix.chat_share else "completion",
                 stream=hang_up or rng.random() < mix.stream_share,
                 temperature=1.0 if rng.random() < mix.sampled_share else 0.0,
                 max_tokens=mix.long_tokens if hang_up or rng.random() < mix.long_share else mix.short_tokens,
                 arm=rng.choice(mix.arms), ignore_eos=hang_up or rng.random() < mix.ignore_eos_share,
                 disconnect_after=rng.randint(1, 2) if hang_up else 0)


def request(shape: Shape, mix: Mix, prompt: str, seed: int) -> tuple[str, dict | bytes]:
    """(path, body) of one request of this shape."""
    if shape.kind == "bad":
        return bad_requests(mix.model)[shape.bad]
    body = {"model": mix.model, "max_tokens": shape.max_tokens, "temperature": shape.temperature,
            "ignore_eos": shape.ignore_eos, "speculative": speculative(shape.arm, mix.gamma), "stream": shape.stream}
    if shape.temperature > 0:
        body["seed"] = seed
    if shape.stream:
        body["stream_options"] = {"include_usage": True}
    if shape.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def finish_error(shape: Shape, finish: str | None, tokens: int) -> str:
    """Why a finish reason contradicts the request ("" when it does not)."""
    if finish not in ("stop", "length"):
        return f"finish_reason {finish!r}"
    if tokens > shape.max_tokens or (finish == "length" and tokens != shape.max_tokens):
        return f"{finish} after {tokens} of max_tokens {shape.max_tokens}"
    if shape.ignore_eos and finish != "length":
        return f"ignore_eos request finished with {finish} after {tokens} tokens"
    return ""


async def send(http: httpx.AsyncClient, shape: Shape, path: str, body: dict | bytes, t0: float) -> RequestRecord:
    """Send one request and check what comes back; never raises for what the server or network does."""
    out = RequestRecord(shape, time.perf_counter() - t0)
    sent = time.perf_counter()
    content = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    try:
        if shape.stream:
            await _streamed(http, path, content, out, sent)
        else:
            await _unary(http, path, content, out, sent)
    except httpx.HTTPError as error:
        out.error, out.detail = "transport", f"{type(error).__name__}: {error}"
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
        out.error, out.detail = "stream_error", f"unexpected body ({type(error).__name__}: {error})"
    return out


async def _unary(http: httpx.AsyncClient, path: str, content: dict, out: RequestRecord, sent: float) -> None:
    r = await http.post(path, **content)
    out.status, out.e2el_s = r.status_code, time.perf_counter() - sent
    expected = 400 if out.shape.kind == "bad" else 200
    if r.status_code != expected:
        out.error, out.detail = "unexpected_status", f"HTTP {r.status_code}: {r.text[:200]}"
        return
    data = r.json()
    if expected == 400:
        if not data["error"]["message"]:
            out.error, out.detail = "stream_error", "400 without an error message"
        return
    out.finish, out.output_tokens = data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]
    _check_finish(out)


async def _streamed(http: httpx.AsyncClient, path: str, content: dict, out: RequestRecord, sent: float) -> None:
    async with http.stream("POST", path, **content) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error, out.detail = "unexpected_status", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        done = await _read_events(r, out)
    out.e2el_s = (out.chunks[-1] if out.chunks else time.perf_counter()) - sent
    out.ttft_s = out.chunks[0] - sent if out.chunks else None
    if out.disconnected or out.error:
        return
    if not done:
        out.error, out.detail = "stream_error", "stream ended without [DONE]"
        return
    _check_finish(out)


async def _read_events(r: httpx.Response, out: RequestRecord) -> bool:
    """Consume SSE events into `out` → whether `[DONE]` arrived; stops early to hang up or on an error event."""
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return True
        event = json.loads(line[6:])
        if "error" in event:
            out.error, out.detail = "stream_error", str(event["error"].get("message"))[:200]
            return False
        out.output_tokens = (event.get("usage") or {}).get("completion_tokens", out.output_tokens)
        for choice in event["choices"]:
            out.finish = choice.get("finish_reason") or out.finish
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                out.chunks.append(time.perf_counter())
        if out.shape.disconnect_after and len(out.chunks) >= out.shape.disconnect_after:
            out.disconnected = True  # leaving the `async with` closes the connection mid-stream
            return False
    return False


def _check_finish(out: RequestRecord) -> None:
    detail = finish_error(out.shape, out.finish, out.output_tokens)
    if detail:
        out.error, out.detail = "wrong_finish", detail
