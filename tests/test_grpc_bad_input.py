"""Malformed messages to the gRPC services (real tier processes over loopback), as hypothesis properties.

Each campaign turns valid messages aimed at a request the test holds into malformed ones, one fault each.
Every one must end its call with INVALID_ARGUMENT, or FAILED_PRECONDITION for a stale cycle or an unknown
request, and change nothing: Load reads the same after each, and after the campaign every worker is alive
and SERVING, the held request goes on exactly as plain greedy decoding does, and once the test has released
its requests no KV slot or draft context is left. The messages and their faults come from tests/malformed.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import Phase, given, settings

from cluster.launcher import start_tiers
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import OPTIONS, GrpcServer
from protos.validate import MAX_GAMMA
from router.api.grpc import RouterServicer
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.model_config import ModelConfig
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.malformed import (
    DRAFT_FAULTS,
    GENERATE_FAULTS,
    MAX_TOKENS,
    METHODS,
    OPEN_FAULTS,
    PREFILL_FAULTS,
    VERIFY_FAULTS,
    Limits,
    base_draft,
    base_open,
    base_prefill,
    base_verify,
    full_open,
    malformed,
    valid_block,
)
from tests.tiers import PROMPTS, TARGET, drafter_settings, plain_greedy, verifier_settings

OK, TIMEOUT_S = grpc.StatusCode.OK, 30.0
HELD = ["held", "held-g", "held-s", "held-r", "held-d", "twin-d", "full-d"]  # request ids the tests hold


class Tier:
    def __init__(self, process, stub, service: str):
        self.process, self.service = process, service
        self.channel = grpc.insecure_channel(process.address, options=OPTIONS)
        self.stub = stub(self.channel)

    def assert_serving(self) -> None:
        assert self.process.process.poll() is None, f"{self.service} died"
        assert_serving(self.channel, self.service)

    def load(self) -> tuple:
        r = self.stub.Load(pb.LoadRequest(), timeout=TIMEOUT_S)
        return (r.contexts, r.queued) if isinstance(r, pb.DrafterLoadReply) else (r.running, r.waiting, r.kv_used)


def assert_serving(channel: grpc.Channel, service: str) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return OK


def exchange(method, msg) -> list:
    """One message on a fresh stream, then the client half-closes (which frees a request it served)."""
    return list(method(iter([msg]), timeout=TIMEOUT_S))


def settled(tier: Tier, want: tuple, timeout_s: float = 10.0) -> tuple:
    """The tier's load once it equals `want` (a stream's end frees state asynchronously), else the last read."""
    deadline = time.monotonic() + timeout_s
    while (got := tier.load()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def campaign(tiers: list[Tier], send, strategy, examples: int = 40) -> None:
    """Each malformed message gets its status and leaves every tier's load as it was; the tiers keep serving."""
    def check(case):
        msg, code = case
        before = [tier.load() for tier in tiers]
        got = status(lambda: send(msg))
        assert got == code, f"{got.name} instead of {code.name}"
        assert [tier.load() for tier in tiers] == before

    # No example database: every campaign shares `check`, and a saved example would replay into the others.
    # No shrinking: the tiers keep state, so a shrunk replay after a failure could report a different cause;
    # the first failing example is the one to read.
    settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])(
        given(strategy)(check))()
    for tier in tiers:
        tier.assert_serving()


@pytest.fixture(scope="module")
def tiers():
    drafters = [f"{TARGET}-{m}" for m in sorted(METHODS)]
    procs = start_tiers([("verifier", verifier_settings(lease_s=3600)),  # held requests outlive the campaigns
                         ("drafter", drafter_settings(drafters=drafters))])
    tiers = Tier(procs[0], rpc.VerifierStub, "dspark.v1.Verifier"), Tier(procs[1], rpc.DrafterStub, "dspark.v1.Drafter")
    yield tiers
    for tier in tiers:
        tier.channel.close()
        tier.process.stop()


@pytest.fixture(scope="module")
def lim(tiers) -> Limits:
    p = tiers[0].stub.Profile(pb.ProfileRequest(), timeout=TIMEOUT_S)
    tokenizer = TextTokenizer.from_dir(resolve_model(TARGET))
    prompts = [tokenizer.encode(text) for text in PROMPTS[:2]]
    reply = prefill(tiers[0], "features", prompts[0])
    tiers[0].stub.Release(pb.ReleaseRequest(request_id="features"), timeout=TIMEOUT_S)
    return Limits(p.vocab_size, p.max_len, len(p.tap_layers) * p.hidden_size,
                  ModelConfig.from_dir(resolve_model(TARGET)).max_context, prompts,
                  plain_greedy(prompts, [MAX_TOKENS] * len(prompts)), [*prompts[0], *reply.emitted], reply.features)


@pytest.fixture(autouse=True)
def _release_held(tiers):
    """A failed test leaves nothing held for the next one."""
    yield
    for tier in tiers:
        for rid in HELD:
            tier.stub.Release(pb.ReleaseRequest(request_id=rid), timeout=TIMEOUT_S)


def prefill(verifier: Tier, rid: str, prompt: list[int], **params) -> pb.PrefillReply:
    return verifier.stub.Prefill(pb.PrefillRequest(request_id=rid, prompt_ids=prompt, feature_dtype=pb.DTYPE_FLOAT32,
                                                   params=pb.SamplingParams(max_tokens=MAX_TOKENS, **params)),
                                 timeout=TIMEOUT_S)


def continues_greedy(verifier: Tier, rid: str, expected: list[int]) -> None:
    """Cycle 1 of a held greedy request, drafting the next two reference tokens, emits them and the bonus."""
    reply, = exchange(verifier.stub.Verify, pb.VerifyRequest(request_id=rid, cycle=1,
                                                             draft=pb.DraftBlock(tokens=expected[1:3])))
    assert list(reply.emitted) == expected[1:4] and reply.num_accepted == 2


# ---- verifier ---------------------------------------------------------------------------------------------
def test_malformed_prefills_are_rejected_and_hold_nothing(tiers, lim):
    verifier = tiers[0]
    prefill(verifier, "held", lim.prompts[0])
    campaign([verifier], lambda m: verifier.stub.Prefill(m, timeout=TIMEOUT_S), malformed(base_prefill,
                                                                                         PREFILL_FAULTS, lim))
    continues_greedy(verifier, "held", lim.greedy[0])
    assert settled(verifier, (0, 0, 0)) == (0, 0, 0)


def test_malformed_verify_cycles_are_rejected_and_change_nothing(tiers, lim):
    verifier = tiers[0]
    prefill(verifier, "held-g", lim.prompts[0])
    prefill(verifier, "held-s", lim.prompts[1], temperature=0.8, seed=7)
    campaign([verifier], lambda m: exchange(verifier.stub.Verify, m), malformed(base_verify, VERIFY_FAULTS, lim), 60)
    continues_greedy(verifier, "held-g", lim.greedy[0])
    reply, = exchange(verifier.stub.Verify, pb.VerifyRequest(request_id="held-s", cycle=1,
                                                             draft=valid_block([5, 6, 7], 4, lim.vocab)))
    assert reply.cycle == 1 and len(reply.emitted) == reply.num_accepted + 1 and reply.num_drafts == 3
    assert settled(verifier, (0, 0, 0)) == (0, 0, 0)


# ---- drafter ----------------------------------------------------------------------------------------------
def drafts_like_a_fresh_context(drafter: Tier, lim: Limits, cycle: int, method: str) -> None:
    """The held context drafts exactly what a context opened now from the same tokens and features drafts."""
    drafter.stub.Open(base_open(None, lim, "twin-d", cycle, method), timeout=TIMEOUT_S)
    blocks = [exchange(drafter.stub.Draft, pb.DraftRequest(request_id=rid, cycle=cycle + 1, gamma=7))[0].block
              for rid in ("held-d", "twin-d")]
    assert list(blocks[0].tokens) == list(blocks[1].tokens) and len(blocks[0].tokens) == 7
    assert settled(drafter, (0, 0)) == (0, 0)


def test_malformed_opens_are_rejected_and_hold_nothing(tiers, lim):
    drafter = tiers[1]
    drafter.stub.Open(base_open(None, lim, "held-d", method="eagle3"), timeout=TIMEOUT_S)  # the chain drafter
    campaign([drafter], lambda m: drafter.stub.Open(m, timeout=TIMEOUT_S), malformed(base_open, OPEN_FAULTS, lim))
    drafts_like_a_fresh_context(drafter, lim, 0, "eagle3")


def test_malformed_draft_cycles_are_rejected_and_change_nothing(tiers, lim):
    drafter = tiers[1]
    drafter.stub.Open(base_open(None, lim, "held-d", 3, "dspark"), timeout=TIMEOUT_S)  # the block drafter
    campaign([drafter], lambda m: exchange(drafter.stub.Draft, m), malformed(base_draft, DRAFT_FAULTS, lim), 60)
    drafter.stub.Open(full_open(lim), timeout=TIMEOUT_S)
    reply, = exchange(drafter.stub.Draft, pb.DraftRequest(request_id="full-d", cycle=1, gamma=MAX_GAMMA))
    assert len(reply.block.tokens) == 1
    drafts_like_a_fresh_context(drafter, lim, 3, "dspark")


# ---- router -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(tiers, lim):
    """dspark.v1.Router served from this process (its own event loop, in a thread) over the two tiers."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        clients = GrpcVerifier(tiers[0].process.address), GrpcDrafter(tiers[1].process.address)
        tokenizer = TextTokenizer.from_dir(resolve_model(TARGET))
        router = Router(*clients, METHODS, RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)), tokenizer)
        server = GrpcServer("127.0.0.1", 0, ["dspark.v1.Router"])
        rpc.add_RouterServicer_to_server(RouterServicer(router, tokenizer, lim.max_len), server.server)
        await server.start()
        return server, clients

    async def stop():
        await server.stop(0)
        for client in clients:
            await client.close()

    server, clients = asyncio.run_coroutine_threadsafe(start(), loop).result(TIMEOUT_S)
    channel = grpc.insecure_channel(server.address, options=OPTIONS)
    yield rpc.RouterStub(channel), channel, thread
    channel.close()
    asyncio.run_coroutine_threadsafe(stop(), loop).result(TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_malformed_generate_requests_are_rejected_and_change_nothing(tiers, router, lim):
    stub, channel, thread = router
    prefill(tiers[0], "held-r", lim.prompts[0])  # a router client below names its own request "held-r" too
    valid = pb.GenerateRequest(prompt_ids=lim.prompts[1], params=pb.SamplingParams(max_tokens=MAX_TOKENS))
    campaign(list(tiers), lambda m: list(stub.Generate(m, timeout=TIMEOUT_S)),
             malformed(lambda d, L: pb.GenerateRequest.FromString(valid.SerializeToString()), GENERATE_FAULTS, lim))
    assert thread.is_alive()
    assert_serving(channel, "dspark.v1.Router")
    valid.request_id = "held-r"
    chunks = list(stub.Generate(valid, timeout=TIMEOUT_S))
    assert [t for c in chunks for t in c.token_ids] == lim.greedy[1] and {c.request_id for c in chunks} == {"held-r"}
    continues_greedy(tiers[0], "held-r", lim.greedy[0])  # the router's "held-r" left the verifier's own alone
    assert (settled(tiers[0], (0, 0, 0)), settled(tiers[1], (0, 0))) == ((0, 0, 0), (0, 0))
