"""Helpers for tests of the tiered system: tier processes, an HTTP server thread, plain greedy baselines."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from cluster.launcher import RedisProcess, start_tiers, stop_tiers
from drafter_worker.settings import DrafterSettings
from in_process.generation import GenerationRequest, InProcessRouter
from router.api.http import ApiConfig, build_app
from router.main import build_router, tier_health
from router.settings import RouterSettings
from services.errors import TierUnavailableError
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.service import LocalVerifier
from verifier_worker.settings import VerifierSettings

TARGET = "dspark-target"
PROMPTS = ["def fibonacci(n):", "import os\n\n", "<|user|>\nWhat is 12 + 30?<|end|>\n<|assistant|>\n",
           "class Stack:\n    def push(self, item):", "The quick brown fox", "for i in range(10):"]


def verifier_settings(**kw) -> VerifierSettings:
    return VerifierSettings(**{"dtype": "float32", "port": 0, "threads": 1, "num_slots": 8, "max_len": 512,
                               "profile": False, **kw})


def drafter_settings(**kw) -> DrafterSettings:
    return DrafterSettings(**{"dtype": "float32", "port": 0, "threads": 1, **kw})


def plain_greedy(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """In-process plain greedy decoding (fp32): the reference every tiered output must equal."""
    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    engine = Engine(load_model(resolve_model(TARGET), "float32", "cpu"), EngineConfig(num_slots=8, max_len=512))
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=m), stop_token_ids=tok.eos_token_ids)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    return [r.token_ids for r in InProcessRouter(engine).generate(reqs)]


@contextmanager
def tier_pair(**verifier_kw):
    """A verifier and a drafter process on free loopback ports for the block's duration → their addresses."""
    verifier, drafter = start_tiers([("verifier", verifier_settings(**verifier_kw)), ("drafter", drafter_settings())])
    try:
        yield verifier.address, drafter.address
    finally:
        stop_tiers([verifier, drafter])


@contextmanager
def private_redis():
    """A redis-server on a free loopback port for the test's duration (skips the test without one)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    server = RedisProcess().start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def api_server(settings: RouterSettings, tracer=None):
    """The router's HTTP API on a free loopback port, in a thread with its own event loop → base URL."""
    state: dict = {}

    async def main():
        router, tokenizer, pools = build_router(settings, tracer)
        config = ApiConfig(router.model, settings.max_model_len, tuple(settings.api_key or ()),
                           settings.max_body_bytes, settings.sse_keepalive_s, settings.strict_fields)
        app = build_app(router, tokenizer, config, lambda: tier_health(pools), tracer)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        state.update(server=server, router=router)
        await pools.refresh()
        await router.start(pools.run)
        await server.serve()
        await router.stop()
        await pools.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (state.get("server") and state["server"].started):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("HTTP server did not start")
        time.sleep(0.05)
    port = state["server"].servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state["router"]
    finally:
        state["server"].should_exit = True
        thread.join(10)


class FlakyVerifier(LocalVerifier):
    """Loses the request (as a restarted replica would) on its third verify call."""

    calls = 0

    async def verify(self, call):
        self.calls += 1
        if self.calls == 3:
            await self.service.release(call.request_id)
            raise TierUnavailableError("replica restarted")
        return await super().verify(call)
