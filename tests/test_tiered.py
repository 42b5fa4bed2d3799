"""The tiered system end to end: verifier and drafter in their own processes, real loopback gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from benchmarks.net_proxy import NetProxy
from cluster.launcher import start_tier, start_tiers, stop_tiers
from drafter_worker.main import drafter_service
from drafter_worker.service import LocalDrafter
from protos import codec
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer, channel
from router.api.grpc import RouterServicer
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.errors import InvalidRequestError, TierUnavailableError
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.tiers import PROMPTS, TARGET, FlakyVerifier, drafter_settings, plain_greedy, verifier_settings
from verifier_worker.main import verifier_service
from verifier_worker.service import LocalVerifier

METHODS = {"dspark", "dflash", "eagle3", "mtp"}
MIX = [("none", "none"), ("dspark", "fixed"), ("mtp", "mtp1"), ("eagle3", "fixed"), ("dflash", "threshold"),
       ("dspark", "threshold")]


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_dir(resolve_model(TARGET))


@pytest.fixture(scope="module")
def tiers():
    # profiled: policy dspark plans with the verifier's SPS(B) table (measured once per host: verifier_worker/profile)
    verifier, drafter = start_tiers([("verifier", verifier_settings(profile=True)), ("drafter", drafter_settings())])
    yield verifier, drafter
    stop_tiers([verifier, drafter])


def _requests(tokenizer, n: int) -> list[RouterRequest]:
    out = []
    for i in range(n):
        method, policy = MIX[i % len(MIX)]
        out.append(RouterRequest(tokenizer.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_tokens=8 + 7 * i),
                                 request_id=f"req-{i}", stop_token_ids=tokenizer.eos_token_ids,
                                 speculative={"method": method, "policy": policy, "gamma": 7}))
    return out


async def _collect(router: Router, request: RouterRequest, on_chunk=None) -> list[int]:
    tokens = []
    async for chunk in router.generate(request):
        tokens += chunk.token_ids
        if on_chunk is not None:
            on_chunk(chunk)
    return tokens


def _router(verifier, drafter, tokenizer) -> Router:
    return Router(verifier, drafter, METHODS, RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)), tokenizer)


def test_concurrent_mixed_requests_equal_in_process_plain_greedy(tiers, tokenizer):
    requests = _requests(tokenizer, 12)

    async def run():
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(tiers[1].address)
        router = _router(verifier, drafter, tokenizer)
        outputs = await asyncio.gather(*[_collect(router, r) for r in requests])
        load, dload = await verifier.load(), await drafter.load()
        accepted = router.metrics.num_accepted_tokens.labels("")._value.get()
        await verifier.close()
        await drafter.close()
        return outputs, load, dload, accepted

    outputs, load, dload, accepted = asyncio.run(run())
    assert outputs == plain_greedy([r.prompt_ids for r in requests], [r.params.max_tokens for r in requests])
    assert accepted > 0  # the drafters really drafted over the wire
    assert load.running == 0 and load.kv_used == 0 and dload.contexts == 0  # every session released


def test_latency_and_loss_between_the_router_and_each_tier_change_no_token(tiers, tokenizer):
    """Each tier behind a path of 5 ms round trip and 2 % loss (a lost segment arrives a 200 ms retransmission
    late, as TCP delivers it; benchmarks/net_proxy.py, this kernel having no netem): every request completes with
    plain greedy's tokens, and every session is released."""
    requests = _requests(tokenizer, 6)
    paths = [NetProxy(tier.address, one_way_s=0.0025, loss=0.02, seed=i) for i, tier in enumerate(tiers)]

    async def run():
        verifier, drafter = GrpcVerifier(paths[0].address), GrpcDrafter(paths[1].address)
        router = _router(verifier, drafter, tokenizer)
        outputs = await asyncio.gather(*[_collect(router, r) for r in requests])
        load, dload = await verifier.load(), await drafter.load()
        await verifier.close()
        await drafter.close()
        return outputs, load, dload

    try:
        outputs, load, dload = asyncio.run(run())
    finally:
        for path in paths:
            path.close()
    assert outputs == plain_greedy([r.prompt_ids for r in requests], [r.params.max_tokens for r in requests])
    assert load.running == 0 and dload.contexts == 0
    assert all(path.stats.chunks > 0 for path in paths) and sum(path.stats.lost for path in paths) > 0


def test_the_planner_counts_the_drafters_round_trip_in_what_drafting_costs(tiers, tokenizer):
    """What drafting adds to a cycle (`VerifyBudget.draft_extra_s`, which `plan_budget` weighs against the tokens
    drafts buy) is measured on whole cycles, so the round trip to the drafter is in it by construction: behind a
    path of 100 ms round trip it is at least 80 ms above the same path without the delay. Requests under an
    SLA draft every cycle of policy dspark, so every cycle is a sample."""
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    spec = Speculation("dspark", Policy.DSPARK, 7, min_tokens_per_s=1000.0)

    async def run(one_way_s: float):
        path = NetProxy(tiers[1].address, one_way_s=one_way_s)
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(path.address)
        router = _router(verifier, drafter, tokenizer)
        await router.start()
        for _ in range(600):  # the verifier's SPS(B) profile, fetched at start: the plan's cost of a step
            if router.planner.sps is not None:
                break
            await asyncio.sleep(0.05)
        assert router.planner.sps is not None, "the router got no SPS profile from the verifier"
        outputs = [await _collect(router, RouterRequest(ids, SamplingParams(max_tokens=40), request_id=f"rtt-{i}",
                                                        speculative=spec)) for i, ids in enumerate(prompts)]
        budget = router.planner.budget("rtt-done")[1]
        await router.stop()
        await verifier.close()
        await drafter.close()
        path.close()
        return outputs, budget.draft_extra_s

    (direct, direct_s), (far, far_s) = asyncio.run(run(0.0)), asyncio.run(run(0.05))
    assert direct == far == plain_greedy(prompts, [40, 40])
    assert far_s - direct_s >= 0.08, (direct_s, far_s)


def test_killing_the_drafter_mid_stream_keeps_every_request_exact(tiers, tokenizer):
    drafter_proc = start_tier("drafter", drafter_settings())
    requests = [RouterRequest(tokenizer.encode(p), SamplingParams(max_tokens=40), request_id=f"kill-{i}",
                              stop_token_ids=tokenizer.eos_token_ids) for i, p in enumerate(PROMPTS)]
    chunks = []

    def on_chunk(chunk):
        chunks.append(chunk)
        if len(chunks) == 8:
            drafter_proc.kill()

    async def run():
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(drafter_proc.address, timeout_s=2.0)
        router = _router(verifier, drafter, tokenizer)
        outputs = await asyncio.gather(*[_collect(router, r, on_chunk) for r in requests])
        detached = router.metrics.drafter_detached.labels("")._value.get()
        await verifier.close()
        await drafter.close()
        return outputs, detached

    try:
        outputs, detached = asyncio.run(run())
    finally:
        drafter_proc.stop()
    assert drafter_proc.process.returncode is not None and detached > 0
    assert outputs == plain_greedy([r.prompt_ids for r in requests], [40] * len(requests))


def test_stale_cycles_and_bad_blocks_are_rejected_and_change_nothing(tiers):
    async def run():
        async with channel(tiers[0].address) as ch:
            stub = rpc.VerifierStub(ch)
            pre = await stub.Prefill(pb.PrefillRequest(request_id="s", prompt_ids=[1, 5, 9],
                                                       params=pb.SamplingParams(max_tokens=8)), timeout=30)
            assert tuple(pre.features.shape)[:1] == (3,) and len(pre.emitted) == 1
            codes = []
            for cycle, draft in ((2, pb.DraftBlock()), (1, pb.DraftBlock(tokens=[10**6]))):
                call = stub.Verify()
                await call.write(pb.VerifyRequest(request_id="s", cycle=cycle, draft=draft))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                codes.append(info.value.code())
            assert (await stub.Load(pb.LoadRequest())).running == 1  # still held, untouched
            call = stub.Verify()
            await call.write(pb.VerifyRequest(request_id="s", cycle=1, draft=pb.DraftBlock(tokens=[3, 4])))
            reply = await call.read()
            call.cancel()  # the client goes away: the server frees the slot
            for _ in range(50):
                if (await stub.Load(pb.LoadRequest())).running == 0:
                    break
                await asyncio.sleep(0.1)
            return codes, reply, await stub.Load(pb.LoadRequest())

    codes, reply, load = asyncio.run(run())
    assert codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT]
    assert reply.cycle == 1 and reply.num_drafts == 2 and len(reply.emitted) == reply.num_accepted + 1
    assert load.running == 0 and load.kv_used == 0


def test_drafter_rejects_inconsistent_context(tiers):
    async def run():
        async with channel(tiers[1].address) as ch:
            stub = rpc.DrafterStub(ch)
            bad = pb.OpenRequest(request_id="d", context_ids=[1, 2, 3], params=pb.SamplingParams(max_tokens=4),
                                 features=codec.tensor_to_pb(torch.zeros(1, 8)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Open(bad, timeout=10)
            return info.value.code(), await stub.Load(pb.LoadRequest())

    code, load = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and load.contexts == 0


def test_a_lost_verifier_is_replaced_by_a_re_prefill_from_committed_tokens(tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])

    async def run():
        service = verifier_service(verifier_settings())
        await service.start()
        router = Router(FlakyVerifier(service), None, set(), RouterConfig(), tokenizer)
        tokens = await _collect(router, RouterRequest(prompt, SamplingParams(max_tokens=30),
                                                      stop_token_ids=tokenizer.eos_token_ids))
        reprefills = router.metrics.verifier_reprefills.labels("")._value.get()
        await service.stop()
        return tokens, reprefills

    t0 = time.perf_counter()
    tokens, reprefills = asyncio.run(run())
    assert reprefills == 1 and time.perf_counter() - t0 < 120
    assert tokens == plain_greedy([prompt], [30])[0]


def test_router_generate_over_grpc_streams_cycles_and_rejects_bad_input(tiers, tokenizer):
    prompt = PROMPTS[3]

    async def run():
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(tiers[1].address)
        server = GrpcServer("127.0.0.1", 0, ["dspark.v1.Router"])
        rpc.add_RouterServicer_to_server(RouterServicer(_router(verifier, drafter, tokenizer), tokenizer, 512),
                                         server.server)
        await server.start()
        async with channel(server.address) as ch:
            stub = rpc.RouterStub(ch)
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt=prompt,
                                                                         params=pb.SamplingParams(max_tokens=24)))]
            # No max_tokens: the rest of the context, HTTP's length rule too.
            rest = [c async for c in stub.Generate(pb.GenerateRequest(prompt=prompt, ignore_eos=True))]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(pb.GenerateRequest(prompt=prompt, prompt_ids=[1, 2])):
                    pass
        await server.stop(0)
        await verifier.close()
        await drafter.close()
        return chunks, rest, info.value.code()

    chunks, rest, code = asyncio.run(run())
    assert rest[-1].completion_tokens == 512 - len(tokenizer.encode(prompt)) and rest[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == plain_greedy([tokenizer.encode(prompt)], [24])[0]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 24
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_router_service_refuses_an_oversize_message_and_serves_on(tiers, tokenizer):
    """Its receive limit is the HTTP body cap, not the tiers' 256 MB: a huge prompt never reaches the tokenizer."""
    async def run():
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(tiers[1].address)
        server = GrpcServer("127.0.0.1", 0, ["dspark.v1.Router"], max_receive_bytes=64 * 1024)
        rpc.add_RouterServicer_to_server(RouterServicer(_router(verifier, drafter, tokenizer), tokenizer, 512),
                                         server.server)
        await server.start()
        async with channel(server.address) as ch:
            stub = rpc.RouterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(pb.GenerateRequest(prompt="x" * 100_000)):
                    pass
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0],
                                                                         params=pb.SamplingParams(max_tokens=4)))]
        await server.stop(0)
        await verifier.close()
        await drafter.close()
        return info.value.code(), chunks

    code, chunks = asyncio.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [t for c in chunks for t in c.token_ids] == plain_greedy([tokenizer.encode(PROMPTS[0])], [4])[0]


def test_a_request_id_already_in_flight_is_refused_and_the_first_request_is_untouched(tiers, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])

    async def run():
        verifier, drafter = GrpcVerifier(tiers[0].address), GrpcDrafter(tiers[1].address)
        router = _router(verifier, drafter, tokenizer)
        first = router.generate(RouterRequest(prompt, SamplingParams(max_tokens=24), request_id="same",
                                              stop_token_ids=tokenizer.eos_token_ids))
        tokens = list((await anext(first)).token_ids)
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await anext(router.generate(RouterRequest(prompt, SamplingParams(max_tokens=4), request_id="same")))
        tokens += [t async for chunk in first for t in chunk.token_ids]
        again = await _collect(router, RouterRequest(prompt, SamplingParams(max_tokens=4), request_id="same",
                                                     stop_token_ids=tokenizer.eos_token_ids))
        await verifier.close()
        await drafter.close()
        return tokens, again

    tokens, again = asyncio.run(run())
    assert tokens == plain_greedy([prompt], [24])[0] and again == tokens[:4]  # the id is free once it finished


def test_sigterm_drains_and_exits_cleanly():
    tier = start_tier("drafter", drafter_settings(drafters=["dspark-target-mtp"]))
    tier.stop()  # SIGTERM: health goes NOT_SERVING, in-flight calls get the grace period, then exit
    assert tier.process.returncode == 0
    pair = start_tiers([("drafter", drafter_settings(drafters=["dspark-target-mtp"]))] * 2)
    stop_tiers(pair)  # one SIGTERM each, sent to both before either is waited for
    assert [t.process.returncode for t in pair] == [0, 0]  # not killed: each drained and exited on its own


class _BlinkingDrafter(LocalDrafter):
    """Unreachable for its 2nd draft call, fine otherwise."""

    def __init__(self, service):
        super().__init__(service)
        self.drafts = self.opens = 0

    async def open(self, call):
        self.opens += 1
        await super().open(call)

    async def draft(self, call):
        self.drafts += 1
        if self.drafts == 2:
            raise TierUnavailableError("drafter unreachable")
        return await super().draft(call)


def test_a_lost_drafter_is_reattached_and_drafts_again(tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])

    async def run():
        vs = verifier_service(verifier_settings())
        ds = drafter_service(drafter_settings(drafters=["dspark-target-dspark"]))
        await vs.start()
        await ds.start()
        drafter = _BlinkingDrafter(ds)
        router = Router(LocalVerifier(vs), drafter, {"dspark"},
                        RouterConfig(default=Speculation("dspark", Policy.FIXED, 7), reattach_every=4), tokenizer)
        tokens = await _collect(router, RouterRequest(prompt, SamplingParams(max_tokens=60),
                                                      stop_token_ids=tokenizer.eos_token_ids))
        await vs.stop()
        await ds.stop()
        return tokens, drafter, router.metrics.drafter_detached.labels("")._value.get()

    tokens, drafter, detached = asyncio.run(run())
    assert tokens == plain_greedy([prompt], [60])[0]
    assert detached == 1 and drafter.opens == 2 and drafter.drafts > 3  # reopened and drafting again


def test_drafting_ahead_over_grpc_keeps_greedy_exact_and_hits(tokenizer):
    """A drafter replica with a speculation cache, a router sending ahead notices: the same tokens as plain
    greedy decoding, and some cycles' blocks drafted ahead (counted by the router), some of them pushed with the
    notice's reply (the router sent no draft request for them)."""
    drafter_proc = start_tier("drafter", drafter_settings(ahead_budget=24))
    verifier_proc = start_tier("verifier", verifier_settings())
    requests = [RouterRequest(tokenizer.encode(p), SamplingParams(max_tokens=40), request_id=f"ahead-{i}",
                              stop_token_ids=tokenizer.eos_token_ids,
                              speculative={"method": method, "policy": "fixed", "gamma": 7, "ahead": True})
                for i, (p, method) in enumerate(zip(PROMPTS, ["dspark", "eagle3", "dflash", "dspark"], strict=False))]

    async def run():
        verifier, drafter = GrpcVerifier(verifier_proc.address), GrpcDrafter(drafter_proc.address)
        router = _router(verifier, drafter, tokenizer)
        outputs = await asyncio.gather(*[_collect(router, r) for r in requests])
        m = router.metrics
        counts = (m.spec_cache_hits.labels("")._value.get(), m.spec_cache_misses.labels("")._value.get(),
                  m.spec_cache_pushed.labels("")._value.get())
        fanout = m.spec_cache_fanout.labels("")
        counts += (fanout._sum.get(), sum(b.get() for b in fanout._buckets))
        dload = await drafter.load()
        await verifier.close()
        await drafter.close()
        return outputs, counts, dload

    try:
        outputs, (hits, misses, pushed, fanout_sum, fanout_count), dload = asyncio.run(run())
    finally:
        drafter_proc.stop()
        verifier_proc.stop()
    assert outputs == plain_greedy([r.prompt_ids for r in requests], [r.params.max_tokens for r in requests])
    assert hits > 0 and misses > 0
    assert pushed <= hits  # those the router held when the verification ended (how many: timing; in process
    # tests/test_run_ahead.py counts them with a slower target)
    assert fanout_count == hits + misses and fanout_sum >= hits  # the fan-out crossed the wire with each reply
    assert dload.contexts == 0
