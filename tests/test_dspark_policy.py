"""Policy dspark end to end: tier processes publishing to a real redis-server, the router reading it.

Redis is stopped and restarted in the middle of a run of requests: no request fails, every greedy
output equals plain decoding, and the scheduler counts the board's load before the outage, its own
during it, and the board's again after it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.launcher import start_tiers, stop_tiers
from router.router import Router, RouterConfig
from router.scheduling.board_view import BoardView
from router.scheduling.planner import VerifyPlanner
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.load_board import RedisBoard
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.tiers import PROMPTS, TARGET, drafter_settings, plain_greedy, private_redis, verifier_settings

CLIENTS = 4


@pytest.fixture(scope="module")
def redis_server():
    with private_redis() as server:
        yield server


@pytest.fixture(scope="module")
def stack(redis_server):
    tiers = start_tiers([("verifier", verifier_settings(redis_url=redis_server.url, profile=True)),
                         ("drafter", drafter_settings(redis_url=redis_server.url))])
    yield tiers
    stop_tiers(tiers)


def _counts(router: Router) -> dict[str, float]:
    return {s: router.metrics.scheduler_cycles.labels("", s)._value.get() for s in ("board", "local")}


def test_redis_outage_mid_run_fails_no_request_and_scheduling_recovers(stack, redis_server):
    tok = TextTokenizer.from_dir(resolve_model(TARGET))

    async def run():
        verifier, drafter = GrpcVerifier(stack[0].address), GrpcDrafter(stack[1].address)
        board = BoardView(RedisBoard(redis_server.url, timeout_s=0.05, cooldown_s=0.3), stale_after_s=0.5)
        config = RouterConfig(default=Speculation("dspark", Policy.DSPARK, 7))
        router = Router(verifier, drafter, {"dspark", "mtp"}, config, tok, planner=VerifyPlanner(0.3, board))
        await router.start()
        while router.planner.sps is None:  # the verifier's SPS profile, over its Profile RPC
            await asyncio.sleep(0.05)
        done, stop = [], asyncio.Event()

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                req = RouterRequest(tok.encode(PROMPTS[(i + n) % len(PROMPTS)]), SamplingParams(max_tokens=24),
                                    request_id=f"c{i}-{n}", stop_token_ids=tok.eos_token_ids)
                tokens = [t async for chunk in router.generate(req) for t in chunk.token_ids]
                done.append((req, tokens))
                n += 1

        clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        marks = []
        for action, wait_s in ((None, 2.5), (redis_server.stop, 2.5), (redis_server.start, 3.5)):
            if action is not None:
                action()
            await asyncio.sleep(wait_s)
            marks.append(_counts(router))
        stop.set()
        await asyncio.gather(*clients)
        metrics = router.metrics
        trimmed = metrics.trimmed_draft_tokens.labels("")._value.get()
        skipped = metrics.drafts_skipped.labels("")._value.get()
        engine_id = router.planner.engine_id
        await router.stop()
        loads = await verifier.load(), await drafter.load()
        await verifier.close()
        await drafter.close()
        return done, marks, trimmed, skipped, engine_id, loads

    t0 = time.monotonic()
    done, (before, during, after), trimmed, skipped, engine_id, (vload, dload) = asyncio.run(run())
    assert engine_id == stack[0].address
    assert (vload.running, vload.kv_used, dload.contexts) == (0, 0, 0)  # the outage leaked nothing
    assert len(done) >= 2 * CLIENTS and time.monotonic() - t0 < 120
    assert [t for _, t in done] == plain_greedy([r.prompt_ids for r, _ in done], [24] * len(done))
    assert before["board"] > 0  # the board's load counted while Redis was up
    assert during["local"] > before["local"]  # the outage: the router's own load
    assert after["board"] > during["board"]  # and back to the board once Redis returned
    assert trimmed + skipped > 0  # the plans cut drafts, or skipped drafting where it did not pay
