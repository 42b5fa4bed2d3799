"""Bounded queues under a burst: the router's max_running / max_queue, then the verifier's own max_waiting.

The first is SGLang's test_request_queue_validation with our status: both bounds 1, ten concurrent requests long
enough to overlap, exactly two served and eight refused with an OpenAI-shaped 429 and Retry-After, and nothing
left behind. The second holds the only KV slot of a verifier without a queue behind the router's back, so the
router's own bounds are not what refuses the request: the verifier answers RESOURCE_EXHAUSTED, and that must
reach the client as a 429 too, not as a 500. A released slot goes to the queued prefill at once, and a free slot
admits even with no queue.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from cluster.launcher import start_tiers, stop_tiers
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import channel
from router.settings import RouterSettings
from services.errors import CapacityError
from services.types import SamplingParams
from tests.conftest import make_engine
from tests.tiers import TARGET, api_server, drafter_settings, verifier_settings

pytestmark = pytest.mark.slow
BODY = {"model": TARGET, "prompt": "import os\n", "max_tokens": 96, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def tiers() -> dict[str, str]:
    """A verifier with two KV slots and one queue place, a drafter, and a verifier with one slot and no queue."""
    processes = start_tiers([("verifier", verifier_settings(num_slots=2, max_waiting=1)),
                             ("drafter", drafter_settings()),
                             ("verifier", verifier_settings(num_slots=1, max_waiting=0))])
    yield dict(zip(("verifier", "drafter", "no_queue"), (p.address for p in processes), strict=True))
    stop_tiers(processes)


def _is_429(r: httpx.Response) -> bool:
    error = r.json().get("error") or {}
    return (r.status_code == 429 and r.headers.get("retry-after", "").isdigit()
            and error.get("type") == "RateLimitError" and bool(error.get("message")))


async def _burst(url: str, n: int, stream: bool) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return list(await asyncio.gather(*(http.post("/v1/completions", json={**BODY, "stream": stream})
                                           for _ in range(n))))


def _idle(router, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while (router.running or router.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    return router.running == router.waiting == 0


@pytest.mark.parametrize("stream", [False, True])
def test_ten_requests_against_bounds_of_one_serve_two_and_refuse_eight(tiers, stream):
    """Streams too: a stream refused before its first token gets the 429 status, not a 200 and an error event.
    The verifier has exactly the router's one slot and no queue: a request releases its KV slot before its
    running place, so the next one admitted finds the slot free."""
    settings = RouterSettings(verifier=tiers["no_queue"], drafter=tiers["drafter"], max_running=1, max_queue=1,
                              max_model_len=512)
    with api_server(settings) as (url, router):
        responses = asyncio.run(_burst(url, 10, stream))
        assert sorted(r.status_code for r in responses) == [200, 200] + [429] * 8
        assert all(_is_429(r) for r in responses if r.status_code == 429), [r.text for r in responses]
        served = [r for r in responses if r.status_code == 200]
        if stream:
            assert all(r.text.rstrip().endswith("data: [DONE]") and '{"error"' not in r.text for r in served)
        else:
            assert all(r.json()["usage"]["completion_tokens"] == BODY["max_tokens"] for r in served)
        assert _idle(router)
        metrics = httpx.get(url + "/metrics").text
        assert 'dspark:num_requests_running{model_name="dspark-target"} 0.0' in metrics
        assert 'dspark:num_requests_waiting{model_name="dspark-target"} 0.0' in metrics
        assert httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60).status_code == 200


def _prefill(rid: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=rid, prompt_ids=[5, 6, 7], params=pb.SamplingParams(max_tokens=8))


async def _release(stub, rids: list[str]) -> None:
    for rid in rids:
        await stub.Release(pb.ReleaseRequest(request_id=rid))
    while (load := await stub.Load(pb.LoadRequest())).running or load.waiting:
        await asyncio.sleep(0.02)


async def _refusals(verifier: str, url: str) -> tuple[grpc.StatusCode, httpx.Response]:
    """With the verifier's only slot held: what a second Prefill gets, and what the API answers a client."""
    async with channel(verifier) as ch:
        stub = rpc.VerifierStub(ch)
        await stub.Prefill(_prefill("hold"), timeout=60)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(_prefill("beyond"), timeout=60)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return refused.value.code(), await http.post("/v1/completions", json=BODY)
        finally:
            await _release(stub, ["hold"])


def test_a_verifier_without_a_queue_refuses_beyond_its_slot_and_the_client_gets_a_429(tiers):
    settings = RouterSettings(verifier=tiers["no_queue"], drafter=tiers["drafter"], max_model_len=512)
    with api_server(settings) as (url, router):
        code, response = asyncio.run(_refusals(tiers["no_queue"], url))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _is_429(response), (response.status_code, response.text)  # the router's bounds were not full
        assert _idle(router)
        assert httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60).status_code == 200


def test_a_released_slot_goes_to_the_queued_prefill(tiers):
    async def run() -> bool:
        async with channel(tiers["verifier"]) as ch:
            stub = rpc.VerifierStub(ch)
            for rid in ("hold-0", "hold-1"):
                await stub.Prefill(_prefill(rid), timeout=60)
            steps = (await stub.Load(pb.LoadRequest())).steps
            queued = asyncio.ensure_future(stub.Prefill(_prefill("queued"), timeout=60))  # a call, not a coroutine
            while (load := await stub.Load(pb.LoadRequest())).waiting < 1 or load.steps <= steps:
                await asyncio.sleep(0.02)  # a step has found no slot for it: only a release can admit it now
            try:
                await stub.Release(pb.ReleaseRequest(request_id="hold-0"))
                done, _ = await asyncio.wait([queued], timeout=5)
                return bool(done)
            finally:
                queued.cancel()  # the verifier frees a cancelled prefill
                await _release(stub, ["hold-1", "queued"])

    assert asyncio.run(run())


def test_an_engine_without_a_queue_serves_its_slot_and_refuses_beyond_it(tiny_model):
    engine = make_engine(tiny_model, num_slots=1, max_waiting=0)
    engine.add_request("first", [5, 6, 7], SamplingParams(max_tokens=8))  # a free slot: it must be admitted
    engine.step()
    assert engine.num_running == 1
    with pytest.raises(CapacityError):
        engine.add_request("second", [5, 6, 7], SamplingParams(max_tokens=8))
