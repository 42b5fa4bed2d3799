"""The pools on a real two-node Ray cluster (ray.cluster_utils.Cluster, every node on 127.0.0.1).

Drafters are pinned to one node and verifiers to the other through custom resources; the router
(in this process) finds the replicas through the controller and talks gRPC to them. Under streaming
load: pools scale up and down, a drafter's worker process is SIGKILLed (Ray restarts the actor) and a
verifier actor is killed with `ray.kill` (the controller replaces it), and every request still completes
with plain greedy's tokens. A TP = 2 replica gives TP = 1's output.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from cluster.controller import RayDiscovery, create  # noqa: E402
from cluster.settings import ServeSettings  # noqa: E402
from router.main import build_router  # noqa: E402
from router.session import RouterRequest  # noqa: E402
from services.registry import resolve_model  # noqa: E402
from services.tokenizer import TextTokenizer  # noqa: E402
from services.types import SamplingParams  # noqa: E402
from tests.tiers import PROMPTS, TARGET, plain_greedy, private_redis  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 32


def settings(namespace: str, **pools) -> ServeSettings:
    node = {"num_cpus": 0.5, "max_replicas": 3}
    return ServeSettings.model_validate({
        "verifier": {"dtype": "float32", "threads": 1, "num_slots": 8, "max_len": 512, "profile": False},
        "drafter": {"dtype": "float32", "threads": 1, "drafters": ["dspark-target-dspark"]},
        "router": {"method": "dspark", "policy": "fixed", "gamma": 4, "methods": ["dspark"]},
        "ray": {"namespace": namespace},
        "pools": {"verifier": {**node, "resources": {"verifier_node": 1}, **pools.get("verifier", {})},
                  "drafter": {**node, "resources": {"drafter_node": 1}, **pools.get("drafter", {})}}})


def head_cluster() -> Cluster:
    """A local cluster's head node. Ray gives a node a fixed 30 s to register; the first start on a fresh
    machine (cold page cache for the raylet and GCS binaries) has missed it, so a second try is allowed
    (the first try's processes are reaped with this process)."""
    for attempt in range(3):
        try:
            return Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        except Exception as error:  # ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(error):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster():
    c = head_cluster()
    drafter_node = c.add_node(num_cpus=2, resources={"drafter_node": 4})
    verifier_node = c.add_node(num_cpus=2, resources={"verifier_node": 4})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="dspark-test", log_to_driver=False)
    yield {"verifier": verifier_node.node_id, "drafter": drafter_node.node_id}
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def deployment(cluster):
    s = settings("dspark-test")
    controller = create(s)
    ray.get(controller.start.remote(), timeout=180)
    yield s, controller
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_dir(resolve_model(TARGET))


async def serve_while(s: ServeSettings, controller, tokenizer, steps, clients: int = 3):
    """Closed-loop clients through a router over the deployment while `steps` (async callables) run in order;
    → (finished (request, tokens) pairs, the router, per-step snapshots of the verifier placement)."""
    router, _, pools = build_router(s.router, discovery=RayDiscovery(controller),
                                    with_drafter=s.router.method != "none")
    await pools.wait_ready()
    await router.start(pools.run)
    done, stop, spread = [], asyncio.Event(), []

    async def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            req = RouterRequest(tokenizer.encode(PROMPTS[(i + n) % len(PROMPTS)]),
                                SamplingParams(max_tokens=MAX_TOKENS), request_id=f"c{i}-{n}",
                                stop_token_ids=tokenizer.eos_token_ids)
            done.append((req, [t async for chunk in router.generate(req) for t in chunk.token_ids]))
            n += 1

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    try:
        for step in steps:
            await step(pools)
            spread.append(dict(pools.verifiers.load()))
        stop.set()
        await asyncio.gather(*tasks)  # a failed request fails the test here
    finally:
        for task in tasks:
            task.cancel()
        await router.stop()
        await pools.close()
    return done, router, spread


async def until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


def serving(controller, pool: str, count: int, without: str | None = None):
    """Whether `pool` has exactly `count` replicas, all serving (and none is `without`)."""
    async def check() -> bool:
        replicas = (await controller.status.remote())["pools"][pool]["replicas"]
        states = [r["state"] for r in replicas]
        gone = without not in [r["replica_id"] for r in replicas]
        return states.count("serving") == count and len(states) == count and gone
    return check


def assert_plain_greedy(done) -> None:
    assert [t for _, t in done] == plain_greedy([r.prompt_ids for r, _ in done], [MAX_TOKENS] * len(done))


def test_pools_are_placed_by_custom_resources_and_serve_on_loopback(cluster, deployment, tokenizer):
    s, controller = deployment
    for pool in ("verifier", "drafter"):
        actor = ray.get_actor(f"{pool}-0", namespace="dspark-test")
        assert ray.get(actor.node.remote()) == cluster[pool]  # pinned by its custom resource
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    members = ray.get(controller.members.remote())
    assert all(m["address"].startswith("127.0.0.1:") for ms in members.values() for m in ms)

    async def pause(pools):
        await asyncio.sleep(3.0)

    done, router, _ = asyncio.run(serve_while(s, controller, tokenizer, [pause]))
    assert len(done) >= 3
    assert router.metrics.num_draft_tokens.labels(router.model)._value.get() > 0  # the drafter node drafted
    assert_plain_greedy(done)


def test_scaling_each_pool_up_and_down_under_load_fails_no_request(deployment, tokenizer):
    s, controller = deployment

    async def up(pools):
        await controller.scale.remote("verifier", 2)
        await controller.scale.remote("drafter", 2)
        await until(serving(controller, "verifier", 2))
        await until(serving(controller, "drafter", 2))
        await asyncio.sleep(3.0)  # new requests spread over both verifiers

    async def down(pools):
        await controller.scale.remote("verifier", 1)
        await controller.scale.remote("drafter", 1)
        await until(serving(controller, "verifier", 1))  # drained: removed once idle
        await until(serving(controller, "drafter", 1))
        await asyncio.sleep(1.0)

    done, _, spread = asyncio.run(serve_while(s, controller, tokenizer, [up, down]))
    assert sum(1 for n in spread[0].values() if n > 0) == 2  # both verifier replicas held requests
    assert_plain_greedy(done)
    events = ray.get(controller.status.remote())["events"]
    assert [(e["pool"], e["before"], e["after"]) for e in events][-4:] == [
        ("verifier", 1, 2), ("drafter", 1, 2), ("verifier", 2, 1), ("drafter", 2, 1)]


def test_killing_a_drafter_process_then_a_verifier_actor_mid_stream_loses_no_request(deployment, tokenizer):
    s, controller = deployment
    ray.get(controller.scale.remote("verifier", 2))
    ray.get(controller.scale.remote("drafter", 2))
    asyncio.run(until(serving(controller, "verifier", 2)))
    asyncio.run(until(serving(controller, "drafter", 2)))
    killed = {}

    def kill_busiest(pool: str, sigkill: bool):
        """Kill the replica holding most requests: SIGKILL its worker process (Ray restarts the actor and the
        controller starts its server again, at a new address), or `ray.kill` it for good (the controller
        replaces it)."""
        async def step(pools):
            await asyncio.sleep(2.0)
            load = (pools.drafters if pool == "drafter" else pools.verifiers).load()
            victim = max(load, key=load.get)
            assert load[victim] > 0  # it holds requests in flight
            before = (await controller.members.remote())[pool]
            actor = ray.get_actor(victim, namespace="dspark-test")
            if sigkill:
                pid, _ = await actor.ping.remote()
                os.kill(pid, signal.SIGKILL)
            else:
                ray.kill(actor, no_restart=True)
            killed[pool] = victim
            await until(serving(controller, pool, 2, without=None if sigkill else victim))
            if sigkill:
                await until(lambda: moved(pool, victim, before))
        return step

    async def moved(pool: str, victim: str, before: list[dict]) -> bool:
        now = {m["replica_id"]: m["address"] for m in (await controller.members.remote())[pool]}
        old = {m["replica_id"]: m["address"] for m in before}
        return victim in now and now[victim] != old[victim]

    done, router, _ = asyncio.run(serve_while(s, controller, tokenizer, [kill_busiest("drafter", sigkill=True),
                                                                         kill_busiest("verifier", sigkill=False)]))
    assert set(killed) == {"drafter", "verifier"}
    assert router.metrics.drafter_detached.labels(router.model)._value.get() > 0
    assert router.metrics.verifier_reprefills.labels(router.model)._value.get() > 0
    assert_plain_greedy(done)
    asyncio.run(until(idle_replicas(controller), timeout_s=20))  # no KV slot or draft context left behind


def idle_replicas(controller):
    """Whether every replica's own load reports no request, KV slot or draft context in use."""
    async def check() -> bool:
        members = await controller.members.remote()
        loads = [await ray.get_actor(m["replica_id"], namespace="dspark-test").load.remote()
                 for pool in ("verifier", "drafter") for m in members[pool]]
        return bool(loads) and all(ld["running"] == 0 and ld.get("kv_used", 0) == 0 for ld in loads)
    return check


def test_the_autoscaler_scales_verifiers_from_the_load_board(deployment, tokenizer):
    ray.get(deployment[1].shutdown.remote(), timeout=60)  # free the nodes' CPUs
    with private_redis() as redis:
        s = settings("dspark-auto", verifier={"max_replicas": 2, "replicas": 1})
        s.router.method, s.router.redis_url, s.verifier.redis_url = "none", redis.url, redis.url
        # Any KV in use is "saturated", none is "idle": load scales the verifiers up, its end down again.
        s.autoscaler = s.autoscaler.model_validate({"enabled": True, "interval_s": 0.5, "verifier_high": 0.01,
                                                    "verifier_low": 0.005, "upscale_delay_s": 1.0,
                                                    "downscale_delay_s": 2.0, "cooldown_s": 2.0,
                                                    "drain_timeout_s": 10.0})
        controller = create(s)
        try:
            ray.get(controller.start.remote(), timeout=180)

            async def scaled_up(pools):
                await until(serving(controller, "verifier", 2))
                await asyncio.sleep(1.0)  # the router sees the event

            done, router, _ = asyncio.run(serve_while(s, controller, tokenizer, [scaled_up]))
            asyncio.run(until(serving(controller, "verifier", 1)))  # idle again: scaled down
            events = ray.get(controller.status.remote())["events"]
        finally:
            ray.get(controller.shutdown.remote(), timeout=60)
            ray.kill(controller)
    assert [(e["pool"], e["before"], e["after"]) for e in events] == [("verifier", 1, 2), ("verifier", 2, 1)]
    assert all(e["reason"].startswith("signal") for e in events)
    assert router.metrics.scale_events.labels(router.model, "verifier", "up", "autoscaler")._value.get() == 1
    assert_plain_greedy(done)


def test_a_tensor_parallel_replica_equals_tp1(cluster, deployment, tokenizer):
    ray.get(deployment[1].shutdown.remote(), timeout=60)  # free the nodes' CPUs for the shards
    s = settings("dspark-tp", verifier={"tensor_parallel": 2})
    controller = create(s)
    try:
        ray.get(controller.start.remote(), timeout=180)
        replica = ray.get(controller.status.remote())["pools"]["verifier"]["replicas"][0]
        assert replica["state"] == "serving"

        async def pause(pools):
            await asyncio.sleep(3.0)

        done, router, _ = asyncio.run(serve_while(s, controller, tokenizer, [pause], clients=2))
        assert router.metrics.num_accepted_tokens.labels(router.model)._value.get() > 0  # verified drafts, TP = 2
        assert_plain_greedy(done)  # plain_greedy runs the unsharded target (TP = 1)
    finally:
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)


def test_a_pool_whose_replicas_fail_the_same_way_at_start_ends_the_deployment(cluster, deployment):
    """No such drafter: the second replica fails as the first did, and `start` says why instead of replacing
    replicas forever (a replica that dies after serving is still replaced: the tests above)."""
    ray.get(deployment[1].shutdown.remote(), timeout=60)
    s = settings("dspark-fatal")
    s.drafter.drafters = ["no-such-drafter"]
    controller = create(s)
    try:
        with pytest.raises(Exception, match="the drafter pool cannot start: no-such-drafter: neither a model"):
            ray.get(controller.start.remote(), timeout=180)
        time.sleep(1.5)  # three controller steps: none starts another drafter
        status = ray.get(controller.status.remote())
    finally:
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
    assert status["pools"]["drafter"]["replicas"] == []
