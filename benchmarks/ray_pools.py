"""What running the tiers as Ray pools costs and buys, on a local Ray instance (127.0.0.1).

Measured in one run, on the shipped target (fp32, one torch thread per replica), greedy, 48 output
tokens (EOS ignored), prompts round robin from the code / math / chat eval sets, closed loop:
- start: seconds from `ray.init` until the controller's first replicas serve; adding one replica;
- serving: per-user and total tok/s at concurrency c over the Ray deployment, against the same tiers
  as plain child processes (`cluster/launcher.py`) — the data path is the same gRPC, the difference is
  what Ray's own processes take from the machine;
- a killed verifier (of 2): the longest gap between two chunks of any request, and until the
  controller's replacement serves;
- TP = 2 against TP = 1 (plain decoding, c = 1).

    python benchmarks/ray_pools.py [--concurrency 1,4] [--max-tokens 48] [--requests 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

from cluster.ray_local import connect  # before anything imports ray: the local instance listens on loopback
from cluster.settings import RaySettings, ServeSettings

connect(RaySettings(namespace="dspark-bench"))
import ray  # noqa: E402

from benchmarks.policies import load_prompts  # noqa: E402
from cluster.controller import RayDiscovery, create  # noqa: E402
from cluster.launcher import start_tiers, stop_tiers  # noqa: E402
from router.main import build_router  # noqa: E402
from router.session import RouterRequest  # noqa: E402
from router.tiers.pooled import StaticDiscovery  # noqa: E402
from services.registry import resolve_model  # noqa: E402
from services.tokenizer import TextTokenizer  # noqa: E402
from services.types import SamplingParams  # noqa: E402

TIER = {"dtype": "float32", "threads": 1}


def settings(verifiers: int = 1, tp: int = 1, method: str = "dspark") -> ServeSettings:
    return ServeSettings.model_validate({
        "verifier": {**TIER, "num_slots": 16, "max_len": 512, "profile": False},
        "drafter": {**TIER, "drafters": ["dspark-target-dspark"]},
        "router": {"method": method, "policy": "fixed", "gamma": 4, "methods": ["dspark"]},
        "ray": {"namespace": "dspark-bench"},
        "pools": {"verifier": {"replicas": verifiers, "num_cpus": 0.25, "tensor_parallel": tp},
                  "drafter": {"num_cpus": 0.25}}})


async def load(router_settings, discovery, prompts, clients, requests, max_tokens, during=None) -> dict:
    """Closed loop; → per-user / total tok/s and the longest gap between two chunks of one request."""
    router, _, pools = build_router(router_settings, discovery=discovery,
                                    with_drafter=router_settings.method != "none")
    await pools.wait_ready()
    await router.start(pools.run)
    speeds, gaps, tokens = [], [0.0], 0

    async def client(i: int) -> None:
        nonlocal tokens
        for n in range(requests):
            req = RouterRequest(prompts[(i * requests + n) % len(prompts)], SamplingParams(max_tokens=max_tokens))
            t0 = last = time.perf_counter()
            count = 0
            async for chunk in router.generate(req):
                now = time.perf_counter()
                gaps.append(now - last)
                last, count = now, count + len(chunk.token_ids)
            speeds.append(count / (time.perf_counter() - t0))
            tokens += count

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    if during is not None:
        await during(pools)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await router.stop()
    await pools.close()
    return {"per_user": statistics.mean(speeds), "total": tokens / wall, "max_gap_s": max(gaps)}


async def until_serving(controller, pool: str, count: int, without: str | None = None) -> float:
    """Seconds until `pool` has exactly `count` replicas, all serving, none of them `without`."""
    t0 = time.perf_counter()
    while True:
        replicas = (await controller.status.remote())["pools"][pool]["replicas"]
        states = [r["state"] for r in replicas]
        if states.count("serving") == count == len(replicas) and without not in [r["replica_id"] for r in replicas]:
            return time.perf_counter() - t0
        await asyncio.sleep(0.1)


def deploy(s: ServeSettings):
    t0 = time.perf_counter()
    controller = create(s)
    ray.get(controller.start.remote())
    return controller, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "ray-pools-cpu.json")
    a = ap.parse_args()
    prompts = load_prompts(TextTokenizer.from_dir(resolve_model("dspark-target")))
    conc = [int(c) for c in a.concurrency.split(",")]
    run = lambda rs, d, c, during=None: asyncio.run(load(rs, d, prompts, c, a.requests, a.max_tokens, during))  # noqa: E731
    out = {"machine": platform.processor() or platform.machine(), "max_tokens": a.max_tokens, "serving": {}}

    s = settings()
    controller, out["start_s"] = deploy(s)
    ray.get(controller.scale.remote("drafter", 2))
    out["add_drafter_s"] = asyncio.run(until_serving(controller, "drafter", 2))
    ray.get(controller.scale.remote("drafter", 1))
    asyncio.run(until_serving(controller, "drafter", 1))
    for c in conc:
        out["serving"][f"ray c={c}"] = run(s.router, RayDiscovery(controller), c)
    procs = start_tiers([("verifier", s.verifier.model_copy(update={"port": 0})),
                         ("drafter", s.drafter.model_copy(update={"port": 0}))])
    static = StaticDiscovery([procs[0].address], [procs[1].address])
    for c in conc:
        out["serving"][f"processes c={c}"] = run(s.router, static, c)
    stop_tiers(procs)

    ray.get(controller.scale.remote("verifier", 2))
    out["add_verifier_s"] = asyncio.run(until_serving(controller, "verifier", 2))
    killed = {}

    async def kill(pools):
        await asyncio.sleep(1.5)
        load_now = pools.verifiers.load()
        victim = max(load_now, key=load_now.get)
        ray.kill(ray.get_actor(victim, namespace="dspark-bench"))
        killed["replaced_s"] = await until_serving(controller, "verifier", 2, without=victim)

    out["kill_verifier"] = {**run(s.router, RayDiscovery(controller), 4, kill), "replaced_s": killed["replaced_s"]}
    ray.get(controller.shutdown.remote())
    ray.kill(controller)

    for tp in (1, 2):
        st = settings(tp=tp, method="none")
        controller, _ = deploy(st)
        out["serving"][f"tp={tp} c=1 plain"] = run(st.router, RayDiscovery(controller), 1)
        ray.get(controller.shutdown.remote())
        ray.kill(controller)

    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"start {out['start_s']:.1f} s · add a drafter {out['add_drafter_s']:.1f} s · "
          f"add a verifier {out['add_verifier_s']:.1f} s")
    print(f"{'arm':24} {'per-user tok/s':>15} {'total tok/s':>12} {'max gap s':>10}")
    for arm, r in out["serving"].items():
        print(f"{arm:24} {r['per_user']:15.1f} {r['total']:12.1f} {r['max_gap_s']:10.2f}")
    k = out["kill_verifier"]
    print(f"killed verifier (c=4): {k['per_user']:.1f} per-user tok/s, longest stall {k['max_gap_s']:.2f} s, "
          f"replacement serving after {k['replaced_s']:.1f} s")


if __name__ == "__main__":
    main()
