"""Fault injection end to end: tier processes, real loopback gRPC, the HTTP API, concurrent clients.

Each test runs a mix of streaming and non-streaming greedy requests over two verifier and two drafter
replicas, injects one fault while requests are in flight on the victim replica, and checks that
  * every request either completes with exactly plain greedy's text or ends with an OpenAI-shaped
    error (a 503, or an error chunk on a stream): nothing hangs, nothing is silently wrong;
  * afterwards nothing leaks: the router's `num_requests_running/waiting` gauges are 0, and every
    surviving tier's Load reports no KV slot in use, no running request and no drafter context.
Redis outages are covered by test_dspark_policy.py, Ray actor deaths by test_ray_pools.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import httpx
import pytest

from cluster.launcher import TierProcess, start_tier, start_tiers, stop_tiers
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import channel
from router.settings import RouterSettings
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.chaos import ChaosProxy, stalled
from tests.tiers import PROMPTS, TARGET, api_server, drafter_settings, plain_greedy, verifier_settings

pytestmark = pytest.mark.timeout(600)  # fixtures included: tier start-up is slow on a busy machine
ARMS = [{"method": "dspark", "policy": "fixed", "gamma": 7}, {"method": "eagle3", "policy": "fixed", "gamma": 5},
        {"method": "mtp", "policy": "mtp1"}, {"method": "dflash", "policy": "threshold"}]
REQUESTS = 8
MAX_TOKENS = 48
TIER_TIMEOUT_S = 2.0  # the router's deadline per tier call: a stall longer than this is a lost replica
LEASE_S = 5.0  # a verifier frees a prefilled request never attached to a stream after this long


@dataclass
class Outcome:
    status: int
    text: str = ""
    error: dict | None = None


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_dir(resolve_model(TARGET))


@pytest.fixture(scope="module")
def expected(tokenizer) -> list[str]:
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(REQUESTS)]
    return [tokenizer.decode(t) for t in plain_greedy(prompts, [MAX_TOKENS] * REQUESTS)]


@pytest.fixture(scope="module")
def survivors():
    """The replicas no test harms: every request on a victim must be able to move here."""
    tiers = start_tiers([("verifier", verifier_settings(lease_s=LEASE_S)), ("drafter", drafter_settings())])
    yield tiers
    stop_tiers(tiers)


def _victims() -> tuple[TierProcess, TierProcess]:
    verifier, drafter = start_tiers([("verifier", verifier_settings(lease_s=LEASE_S)), ("drafter", drafter_settings())])
    return verifier, drafter


def _settings(verifiers: list[str], drafters: list[str], **kw) -> RouterSettings:
    return RouterSettings(verifier=",".join(verifiers), drafter=",".join(drafters), max_model_len=512,
                          verifier_timeout_s=TIER_TIMEOUT_S,
                          drafter_timeout_s=TIER_TIMEOUT_S, **kw)


async def _request(client: httpx.AsyncClient, url: str, i: int, progress: list[int]) -> Outcome:
    body = {"model": TARGET, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculative": ARMS[i % len(ARMS)], "stream": i % 2 == 0}
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body)
        data = r.json()
        return Outcome(r.status_code, error=data["error"]) if "error" in data else \
            Outcome(r.status_code, data["choices"][0]["text"])
    out = Outcome(0)
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            payload = line.removeprefix("data: ").strip()
            if not line.startswith("data: ") or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                out.error = chunk["error"]
                break
            out.text += chunk["choices"][0]["text"]
            progress[0] += 1
    return out


async def _run(url: str, router, inject, victim_role: str | None = None) -> list[Outcome]:
    """REQUESTS concurrent requests; `inject()` runs in a thread once the victim holds requests mid-stream."""
    async with httpx.AsyncClient(timeout=120) as client:
        progress = [0]  # chunks streamed so far: the requests are mid-stream, past their prefill
        tasks = [asyncio.create_task(_request(client, url, i, progress)) for i in range(REQUESTS)]
        await _until(lambda: _victim_busy(router, victim_role) and progress[0] >= REQUESTS)
        await asyncio.to_thread(inject)
        return await asyncio.gather(*tasks)


def _victim_busy(router, role: str | None) -> bool:
    """The first replica of `role` (the victim, listed first) holds at least two requests."""
    if role is None:
        return router.running >= REQUESTS // 2
    replicas = router.verifier.replicas if role == "verifier" else router.drafter.replicas
    load = replicas.load()
    return bool(load) and load.get(replicas.members()[0].replica_id, 0) >= 2


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the fault's precondition never held"
        await asyncio.sleep(0.02)


def _check_outcomes(outcomes: list[Outcome], expected: list[str], may_fail: bool = False) -> int:
    """Every request exact, or (when `may_fail`) a clear, OpenAI-shaped error. → the number that failed."""
    failed = 0
    for i, out in enumerate(outcomes):
        if out.error is None:
            assert out.status == 200 and out.text == expected[i], f"request {i}: {out}"
            continue
        assert may_fail, f"request {i} failed: {out}"
        assert out.status in (200, 503) and out.error["message"] and out.error["type"], out
        failed += 1
    return failed


def _loads(verifiers: list[str], drafters: list[str]) -> list:
    async def run():
        out = []
        for address in verifiers + drafters:
            async with channel(address) as ch:
                stub = rpc.VerifierStub(ch) if address in verifiers else rpc.DrafterStub(ch)
                out.append(await stub.Load(pb.LoadRequest(), timeout=5))
        return out
    return asyncio.run(run())


def _assert_nothing_leaks(url: str, verifiers: list[str], drafters: list[str], within_s: float = 15.0) -> None:
    """Router gauges and every given tier's Load back to idle (stream cancellations and leases take a moment)."""
    deadline = time.monotonic() + within_s
    while True:
        metrics = httpx.get(url + "/metrics").text
        gauges = [float(v) for v in re.findall(r"^dspark:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$",
                                               metrics, re.M)]
        loads = _loads(verifiers, drafters)
        idle = [(ld.kv_used, ld.running, ld.waiting) == (0, 0, 0) for ld in loads[:len(verifiers)]] + \
               [ld.contexts == 0 for ld in loads[len(verifiers):]]
        if gauges and not any(gauges) and all(idle):
            return
        assert time.monotonic() < deadline, f"leak: router gauges {gauges}, tier loads {loads}"
        time.sleep(0.25)


def test_killing_a_verifier_process_mid_stream_loses_no_request(survivors, expected):
    verifier, drafter = _victims()
    settings = _settings([verifier.address, survivors[0].address], [drafter.address, survivors[1].address])
    try:
        with api_server(settings) as (url, router):
            outcomes = asyncio.run(_run(url, router, verifier.kill, "verifier"))
            _check_outcomes(outcomes, expected)
            assert router.metrics.verifier_reprefills.labels(TARGET)._value.get() >= 2
            _assert_nothing_leaks(url, [survivors[0].address], [drafter.address, survivors[1].address])
    finally:
        stop_tiers([verifier, drafter])


def test_killing_a_drafter_process_mid_stream_loses_no_request(survivors, expected):
    verifier, drafter = _victims()
    settings = _settings([verifier.address, survivors[0].address], [drafter.address, survivors[1].address])
    try:
        with api_server(settings) as (url, router):
            outcomes = asyncio.run(_run(url, router, drafter.kill, "drafter"))
            _check_outcomes(outcomes, expected)
            assert router.metrics.drafter_detached.labels(TARGET)._value.get() >= 2
            _assert_nothing_leaks(url, [verifier.address, survivors[0].address], [survivors[1].address])
    finally:
        stop_tiers([verifier, drafter])


def test_cut_grpc_connections_lose_no_request_and_free_the_far_side(survivors, expected):
    """Every TCP connection to one verifier and one drafter is reset mid-stream; both keep running."""
    verifier, drafter = _victims()
    proxies = [ChaosProxy(verifier.address), ChaosProxy(drafter.address)]
    settings = _settings([proxies[0].address, survivors[0].address], [proxies[1].address, survivors[1].address])
    try:
        with api_server(settings) as (url, router):
            outcomes = asyncio.run(_run(url, router, lambda: [p.cut() for p in proxies], "verifier"))
            _check_outcomes(outcomes, expected)
            assert proxies[0].cuts >= 1 and proxies[1].cuts >= 1
            assert router.metrics.verifier_reprefills.labels(TARGET)._value.get() >= 2
            _assert_nothing_leaks(url, [verifier.address, survivors[0].address], [drafter.address,
                                                                                   survivors[1].address])
    finally:
        for proxy in proxies:
            proxy.close()
        stop_tiers([verifier, drafter])


def test_a_verifier_stalled_past_its_deadline_loses_no_request_and_frees_its_slots(survivors, expected):
    """SIGSTOP a verifier for longer than the router's deadline: its requests move; once it resumes, the
    streams the router abandoned are cancelled there and its KV slots come back."""
    verifier, drafter = _victims()
    settings = _settings([verifier.address, survivors[0].address], [drafter.address, survivors[1].address])

    def stall() -> None:
        with stalled(verifier.process.pid):
            time.sleep(3 * TIER_TIMEOUT_S)

    try:
        with api_server(settings) as (url, router):
            t0 = time.monotonic()
            outcomes = asyncio.run(_run(url, router, stall, "verifier"))
            _check_outcomes(outcomes, expected)
            assert router.metrics.verifier_reprefills.labels(TARGET)._value.get() >= 2
            assert time.monotonic() - t0 < 90
            _assert_nothing_leaks(url, [verifier.address, survivors[0].address],
                                  [drafter.address, survivors[1].address], within_s=LEASE_S + 10)
    finally:
        stop_tiers([verifier, drafter])


def test_losing_the_only_verifier_ends_every_request_with_a_clear_error(survivors, expected):
    """No replica to move to: after the retry window each request gets a 503 or an error chunk, none hangs,
    /health says 503, and the router holds nothing."""
    verifier = start_tier("verifier", verifier_settings())
    settings = _settings([verifier.address], [survivors[1].address], verifier_retry_s=2.0)
    try:
        with api_server(settings) as (url, router):
            outcomes = asyncio.run(_run(url, router, verifier.kill))
            failed = _check_outcomes(outcomes, expected, may_fail=True)
            assert failed >= REQUESTS // 2
            assert httpx.get(url + "/health").status_code == 503
            _assert_nothing_leaks(url, [], [survivors[1].address])
    finally:
        verifier.stop()


def test_a_failing_engine_step_drops_its_requests_and_the_verifier_serves_on(tokenizer):
    """vLLM's "evil forward": the 5th engine step raises. The verifier drops that step's requests as if it had
    been lost, its loop keeps serving, and the router re-prefills them: every output still exact, nothing held."""
    from router.router import Router, RouterConfig
    from router.session import RouterRequest
    from services.types import SamplingParams
    from verifier_worker.main import verifier_service
    from verifier_worker.service import LocalVerifier

    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]

    async def run():
        service = verifier_service(verifier_settings())
        step, calls = service.engine.step, [0]

        def evil_step():
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("injected fault")
            return step()

        service.engine.step = evil_step
        await service.start()
        router = Router(LocalVerifier(service), None, set(), RouterConfig(), tokenizer)

        async def collect(i: int) -> list[int]:
            req = RouterRequest(prompts[i], SamplingParams(max_tokens=24), request_id=f"evil-{i}",
                                stop_token_ids=tokenizer.eos_token_ids)
            return [t async for chunk in router.generate(req) for t in chunk.token_ids]

        outputs = await asyncio.gather(*[collect(i) for i in range(len(prompts))])
        load = service.load()
        await service.stop()
        return outputs, router.metrics.verifier_reprefills.labels("")._value.get(), load, calls[0]

    outputs, reprefills, load, steps = asyncio.run(run())
    assert steps > 5 and reprefills >= 1
    assert outputs == plain_greedy(prompts, [24] * len(prompts))
    assert (load.running, load.waiting, load.kv_used) == (0, 0, 0)
