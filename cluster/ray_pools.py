"""One pool of replica actors on Ray: create with the pool's resources, watch, replace, drain, remove.

A replica is a named actor (`verifier-3`, `drafter-0`) in the deployment's namespace; a tensor-parallel
verifier replica is a STRICT_PACK placement group of `tensor_parallel` bundles (one node), rank 0 in
bundle 0 and its shards in the others, failing as one unit. `check` pings every replica: a dead
one (killed, or out of restarts) is removed and `reconcile` starts a replacement; a restarted one
(Ray re-ran its constructor) is started again. Removal drains: the replica leaves placement at
once, and is killed when it holds no request or after the drain timeout. Only async calls here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.actors import DrafterReplica, VerifierReplica, VerifierShard
from cluster.settings import PoolSettings

log = logging.getLogger(__name__)
_ACTORS = {"verifier": ray.remote(VerifierReplica), "drafter": ray.remote(DrafterReplica)}
_SHARD = ray.remote(VerifierShard)


@dataclass(slots=True)
class Replica:
    replica_id: str
    actor: ray.actor.ActorHandle
    shards: list[ray.actor.ActorHandle] = field(default_factory=list)
    group: PlacementGroup | None = None
    address: str | None = None  # None until serving (or while restarting)
    draining_since: float | None = None
    starting: asyncio.Task | None = None
    draining: asyncio.Task | None = None
    follows: list[asyncio.Future] = field(default_factory=list)  # shards' follow loops (done = shard gone)


class ActorPool:
    def __init__(self, role: str, settings: dict, pool: PoolSettings, namespace: str, start_timeout_s: float = 300.0):
        self.role, self.settings, self.pool, self.namespace = role, settings, pool, namespace
        self.target = pool.replicas
        self.start_timeout_s = start_timeout_s
        self.replicas: dict[str, Replica] = {}
        self._serial = 0
        # A start that fails the same way twice before any replica served (no model, unreadable files) is the
        # deployment's fault, not a replica's: the pool stops replacing and `fatal` says why.
        self.served = False
        self.fatal: str | None = None
        self._start_failures: list[str] = []

    # ---- what the router sees ----------------------------------------------------------------
    def members(self) -> list[dict]:
        return [{"replica_id": r.replica_id, "address": r.address, "draining": r.draining_since is not None}
                for r in self.replicas.values() if r.address is not None]

    def active(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.draining_since is None]

    # ---- lifecycle ------------------------------------------------------------------------------
    def _options(self, name: str | None, bundle: tuple[PlacementGroup, int] | None) -> dict:
        p = self.pool
        opts: dict = {"num_cpus": p.num_cpus, "num_gpus": p.num_gpus, "namespace": self.namespace,
                      "max_restarts": p.max_restarts if p.tensor_parallel == 1 else 0}
        if name is not None:
            opts["name"] = name
        if bundle is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(bundle[0], bundle[1])
        if p.resources:
            opts["resources"] = dict(p.resources)
        return opts

    def add(self) -> Replica:
        """Create one replica; it joins `members()` once its server answers."""
        rid = f"{self.role}-{self._serial}"
        self._serial += 1
        world = self.pool.tensor_parallel
        if world == 1:
            replica = Replica(rid, _ACTORS[self.role].options(**self._options(rid, None)).remote(self.settings))
        else:
            bundle = {"CPU": self.pool.num_cpus, "GPU": self.pool.num_gpus, **self.pool.resources}
            group = placement_group([{k: v for k, v in bundle.items() if v}] * world, strategy="STRICT_PACK",
                                    name=f"{self.namespace}-{rid}")
            actor = _ACTORS["verifier"].options(**self._options(rid, (group, 0))).remote(self.settings, world)
            shards = [_SHARD.options(**self._options(None, (group, i))).remote(self.settings, i, world)
                      for i in range(1, world)]
            replica = Replica(rid, actor, shards, group)
        self.replicas[rid] = replica
        replica.starting = asyncio.create_task(self._start(replica))
        log.info("%s pool: starting %s", self.role, rid)
        return replica

    async def _start(self, r: Replica) -> None:
        try:
            async with asyncio.timeout(self.start_timeout_s):
                if r.shards:
                    address = await r.actor.group_address.remote()
                    r.follows = [asyncio.ensure_future(s.follow.remote(address)) for s in r.shards]
                r.address = await r.actor.start.remote()
            self.served = True
            log.info("%s pool: %s serving at %s", self.role, r.replica_id, r.address)
        except (TimeoutError, RayActorError) as error:
            log.error("%s pool: %s did not start (%s); replacing it", self.role, r.replica_id,
                      type(error).__name__ if isinstance(error, TimeoutError) else error)
            self._kill(r)
        except RayTaskError as error:  # its start raised, e.g. TLS files missing on that node: say why, once
            reason = str(error.cause)
            if not self.served and reason in self._start_failures:
                self.fatal = reason
                log.error("%s pool: %s failed to start as the one before it did: %s", self.role, r.replica_id,
                          reason)
            else:
                log.error("%s pool: %s failed to start: %s; replacing it", self.role, r.replica_id, reason)
            self._start_failures.append(reason)
            self._kill(r)
        finally:
            r.starting = None

    async def check(self, timeout_s: float = 5.0) -> None:
        """Ping every started replica: drop the dead ones, restart the servers of restarted ones."""
        for r in list(self.replicas.values()):
            if r.starting is not None:
                continue
            try:
                _, address = await asyncio.wait_for(r.actor.ping.remote(), timeout_s)
                lost_shard = any(f.done() for f in r.follows)
            except ActorDiedError as error:
                log.warning("%s pool: %s died (%s)", self.role, r.replica_id, error)
                self._kill(r)
                continue
            except (RayActorError, TimeoutError, GetTimeoutError):
                r.address = None  # restarting or unresponsive: out of placement until it answers
                continue
            if lost_shard:
                log.warning("%s pool: a shard of %s is gone; replacing the replica", self.role, r.replica_id)
                self._kill(r)
            elif address is None:
                r.address = None
                r.starting = asyncio.create_task(self._start(r))

    def reconcile(self, drain_timeout_s: float) -> None:
        """Start or drain replicas until `target` are active (none once the pool cannot start at all)."""
        active = self.active()
        for _ in range(0 if self.fatal else self.target - len(active)):
            self.add()
        surplus = len(active) - self.target
        if surplus > 0:
            # Newest first: they are the likeliest to be still starting or idle.
            for r in sorted(active, key=lambda r: int(r.replica_id.rsplit("-", 1)[1]), reverse=True)[:surplus]:
                r.draining_since = time.monotonic()
                r.draining = asyncio.create_task(self._drain(r, drain_timeout_s))

    async def _drain(self, r: Replica, timeout_s: float) -> None:
        log.info("%s pool: draining %s", self.role, r.replica_id)
        deadline = time.monotonic() + timeout_s
        while r.starting is None and r.address is not None and time.monotonic() < deadline:
            try:
                load = await asyncio.wait_for(r.actor.load.remote(), 5.0)
            except (RayActorError, TimeoutError):
                break
            if not load.get("running") and not load.get("queued"):
                break
            await asyncio.sleep(0.2)
        log.info("%s pool: removing %s", self.role, r.replica_id)
        with contextlib.suppress(RayActorError, TimeoutError):
            await asyncio.wait_for(r.actor.stop.remote(), 5.0)
        self._kill(r)

    def _kill(self, r: Replica) -> None:
        self.replicas.pop(r.replica_id, None)
        if r.starting is not None and r.starting is not asyncio.current_task():
            r.starting.cancel()
        for follow in r.follows:
            if follow.done() and not follow.cancelled():
                follow.exception()  # retrieved: the shard's end is the reason for this kill, already logged
            else:
                follow.cancel()
        for actor in (r.actor, *r.shards):
            ray.kill(actor, no_restart=True)
        if r.group is not None:
            remove_placement_group(r.group)

    def shutdown(self) -> None:
        for r in list(self.replicas.values()):
            self._kill(r)
