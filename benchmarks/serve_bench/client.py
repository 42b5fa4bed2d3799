"""One streamed completion against the OpenAI-compatible API, timed the way vLLM's `bench serve` times it.

TTFT is the first chunk that carries text; every later content chunk adds one inter-chunk gap (ITL;
with speculation several tokens share a chunk); E2EL ends at the last chunk. Output tokens come from
the final usage chunk (`stream_options.include_usage`), not from counting chunks.
"""

from __future__ import annotations

import itertools
import json
import time

import httpx

from benchmarks.serve_bench.metrics import RequestResult

ARMS: dict[str, dict] = {
    "none": {"method": "none"},
    "mtp1": {"method": "mtp", "policy": "mtp1"},
    "eagle3": {"method": "eagle3", "policy": "fixed"},
    "dflash": {"method": "dflash", "policy": "fixed"},
    "dspark-fixed": {"method": "dspark", "policy": "fixed"},
    "dspark": {"method": "dspark", "policy": "dspark"},
    "dspark-ahead": {"method": "dspark", "policy": "dspark", "ahead": True},  # the drafter drafts ahead (SSD)
}


def speculative(arm: str, gamma: int) -> dict:
    """The request's `speculative` options for an arm (fixed-γ and scheduled arms draft γ per cycle)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: {', '.join(ARMS)}")
    options = dict(ARMS[arm])
    if options.get("policy") in ("fixed", "dspark"):
        options["gamma"] = gamma
    return options


async def complete(http: httpx.AsyncClient, arm: str, body: dict, started: float) -> RequestResult:
    """POST one streamed completion; failures become a result with ok=False (they never raise)."""
    sent = time.perf_counter()
    chunks, text, usage = [], [], {}
    try:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:200]
                return _failed(arm, sent - started, f"HTTP {r.status_code}: {detail}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return _failed(arm, sent - started, str(event["error"].get("message")))
                usage = event.get("usage") or usage
                piece = "".join(c.get("text", "") for c in event.get("choices", []))
                if piece:
                    chunks.append(time.perf_counter())
                    text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return _failed(arm, sent - started, f"{type(error).__name__}: {error}")
    end = chunks[-1] if chunks else time.perf_counter()
    return RequestResult(arm, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), "".join(text),
                         (chunks[0] if chunks else end) - sent, end - sent,
                         [b - a for a, b in itertools.pairwise(chunks)], sent_at_s=sent - started)


def _failed(arm: str, sent_at: float, error: str) -> RequestResult:
    return RequestResult(arm, 0, 0, "", 0.0, 0.0, [], ok=False, error=error, sent_at_s=sent_at)
