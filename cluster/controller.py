"""The deployment's controller: a named Ray actor that owns both pools, scales them and reports them.

`dspark serve` creates it as `controller` in the deployment's namespace; routers discover replicas
through `members` (awaited, never a blocking `ray.get` in async code) and `dspark scale` reaches it
by name. Its loop every `interval_s`: ping the replicas (replace the dead, restart the restarted),
let the autoscaler move each pool's target from the load board (or, without a board, from the
replicas' own load), then start or drain replicas to meet the targets. Replicas are its children:
they die with it, and it dies with the `dspark serve` process that owns it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.autoscaler import Autoscaler, ScaleEvent, pool_signal
from cluster.ray_pools import ActorPool
from cluster.settings import ServeSettings
from router.tiers.replicas import Member
from services.errors import DsparkError, InvalidRequestError
from services.load_board import EngineLoad, RedisBoard

log = logging.getLogger(__name__)
CONTROLLER = "controller"


class Controller:
    def __init__(self, settings: dict, interval_s: float = 0.5):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s controller %(levelname)s %(message)s")
        s = self.settings = ServeSettings.model_validate(settings)
        ns = s.ray.namespace
        self.pools = {"verifier": ActorPool("verifier", s.verifier.model_dump(mode="json"), s.pools.verifier, ns)}
        if s.router.method != "none":
            self.pools["drafter"] = ActorPool("drafter", s.drafter.model_dump(mode="json"), s.pools.drafter, ns)
        self.autoscaler = Autoscaler(s.autoscaler, {"verifier": s.pools.verifier, "drafter": s.pools.drafter})
        self.board = RedisBoard(s.router.redis_url) if s.router.redis_url else None
        self.interval_s = interval_s
        self.events: list[ScaleEvent] = []
        self._loop: asyncio.Task | None = None
        self._last_scale = 0.0

    async def start(self, timeout_s: float = 300.0) -> dict:
        """Create the pools and wait until each has a serving replica (or has none wanted) → members."""
        for pool in self.pools.values():
            pool.reconcile(self.settings.autoscaler.drain_timeout_s)
        self._loop = asyncio.create_task(self._run())
        async with asyncio.timeout(timeout_s):
            while any(pool.target and not pool.members() for pool in self.pools.values()):
                for role, pool in self.pools.items():
                    if pool.fatal is not None:
                        raise DsparkError(f"the {role} pool cannot start: {pool.fatal}")
                await asyncio.sleep(0.1)
        return self.members()

    def members(self) -> dict:
        return {role: pool.members() for role, pool in self.pools.items()}

    def status(self) -> dict:
        return {"pools": {role: {"target": p.target, "min": p.pool.min_replicas, "max": p.pool.max_replicas,
                                 "replicas": [{"replica_id": r.replica_id, "address": r.address,
                                               "state": _state(r)} for r in p.replicas.values()]}
                          for role, p in self.pools.items()},
                "events": [asdict(e) for e in self.events]}

    def scale(self, pool: str, replicas: int) -> dict:
        """Set a pool's replica count by hand (`dspark scale`), within its min..max."""
        if pool not in self.pools:
            raise InvalidRequestError(f"no {pool} pool here (pools: {', '.join(self.pools)})")
        p = self.pools[pool]
        if not p.pool.min_replicas <= replicas <= p.pool.max_replicas:
            raise InvalidRequestError(f"{pool} replicas must be in [{p.pool.min_replicas}, {p.pool.max_replicas}] "
                                      f"(pools.{pool}.min_replicas / max_replicas), got {replicas}")
        self._record(ScaleEvent(pool, p.target, replicas, "dspark scale", time.time()))
        self.autoscaler.manual(pool)
        p.target = replicas
        p.reconcile(self.settings.autoscaler.drain_timeout_s)
        return self.status()

    async def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
        for pool in self.pools.values():
            pool.shutdown()

    # ---- the loop ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except Exception:
                log.exception("controller step failed")
            await asyncio.sleep(self.interval_s)

    async def _step(self) -> None:
        for pool in self.pools.values():
            await pool.check()
        a = self.settings.autoscaler
        if a.enabled and time.monotonic() - self._last_scale >= a.interval_s:
            self._last_scale = time.monotonic()
            for role, pool in self.pools.items():
                event = self.autoscaler.decide(role, pool.target, pool_signal(role, await self._loads(role)))
                if event is not None:
                    self._record(event)
                    pool.target = event.after
        for pool in self.pools.values():
            pool.reconcile(a.drain_timeout_s)

    async def _loads(self, role: str) -> list[EngineLoad]:
        """The pool's active replicas' load: their board entries, else (no board) asked of the replicas."""
        active = {r.address: r for r in self.pools[role].active() if r.address is not None}
        if self.board is not None:
            loads = await asyncio.to_thread(self.board.read, role)
            if loads is not None:
                return [x for x in loads if x.engine_id in active]
        out = []
        for address, r in active.items():
            try:
                load = await asyncio.wait_for(r.actor.load.remote(), 2.0)
            except Exception:  # a replica that cannot answer is left out; `check` deals with it
                continue
            out.append(EngineLoad(address, role, **load))
        return out

    def _record(self, event: ScaleEvent) -> None:
        log.info("scale %s: %d → %d (%s)", event.pool, event.before, event.after, event.reason)
        self.events.append(event)


def _state(r) -> str:
    if r.draining_since is not None:
        return "draining"
    return "serving" if r.address is not None else "starting"


def create(settings: ServeSettings):
    """The controller actor of this deployment (owned by the caller: it dies with it), on the caller's own node.
    Placed elsewhere (Ray may pick the head), that node's death would take the controller and with it every
    replica (its children), while the `dspark serve` node's death ends the API anyway. So a router off the Ray
    head serves on through a restart of the head's host (tests/host_faults.py)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Controller).options(name=CONTROLLER, namespace=settings.ray.namespace, num_cpus=0,
                                          max_restarts=0, scheduling_strategy=here
                                          ).remote(settings.model_dump(mode="json"))


class RayDiscovery:
    """The router's view of the pools, from the controller (`router/pooled_tiers.Discovery`): the replicas
    that serve (draining ones marked), and the controller's scale events for the router's metrics."""

    def __init__(self, controller):
        self.controller = controller
        self.events: list[dict] = []

    async def members(self) -> dict[str, list[Member]]:
        status = await self.controller.status.remote()
        self.events = status["events"]
        return {role: [Member(r["replica_id"], r["address"], r["state"] == "draining")
                       for r in pool["replicas"] if r["address"] is not None]
                for role, pool in status["pools"].items()}
