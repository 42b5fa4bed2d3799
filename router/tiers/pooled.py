"""The verifier and drafter tiers as pools of replicas (`VerifierTier` / `DrafterTier` over `ReplicaSet`s).

The router core sees one verifier and one drafter; these adapters place each request on a replica,
keep it there, and turn a replica's failure into the errors the router already recovers from: a
verify on a lost replica raises `TierUnavailableError` (the router re-prefills, which places the
request on another replica), a draft on a lost drafter raises too (the request decodes plainly at
once and reopens its context on another drafter at its next draft). `Discovery` keeps the pools
current: a fixed list of addresses, or the Ray controller's list of live replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from router.metrics import RouterMetrics
from router.tiers.replicas import Member, ReplicaSet
from services.calls import AheadCall, DraftCall, OpenCall, PrefillCall, Pushed, VerifyCall
from services.errors import StaleCycleError, TierUnavailableError
from services.types import DraftBlock, Prefilled, Verified, VerifierProfile

log = logging.getLogger(__name__)
_LOST = (TierUnavailableError, StaleCycleError)


class Discovery(Protocol):
    """Where replicas come from. May also keep `events`: the deployment's scale events so far (dicts with
    pool, before, after, reason), which the router exports as metrics."""

    async def members(self) -> dict[str, list[Member]]: ...  # "verifier" / "drafter" → live replicas


class StaticDiscovery:
    """Fixed addresses (`dspark router --verifier a:1,b:2`); a failed replica is retried after `down_s`."""

    def __init__(self, verifiers: list[str], drafters: list[str]):
        self._members = {"verifier": [Member(a, a) for a in verifiers], "drafter": [Member(a, a) for a in drafters]}

    async def members(self) -> dict[str, list[Member]]:
        return self._members


class _Pooled:
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    def _lost(self, replica_id: str, client, error: Exception) -> None:
        """Mark the replica down and cancel the streams there of every request it held: the requests move on
        their next call, and the cancellations free their KV slots or contexts once the replica answers again
        (a stalled replica would otherwise keep them for as long as the channel lives)."""
        for request_id in self.replicas.fail(replica_id, error):
            client.forget(request_id)

    async def release(self, request_id) -> None:
        placed = self.replicas.placed(request_id)
        self.replicas.unplace(request_id)
        if placed is not None:
            await placed[1].release(request_id)


class PooledVerifier(_Pooled):
    async def prefill(self, call: PrefillCall) -> Prefilled:
        """Placed beside `call.share_prefix_of` (a sibling sample), so its cached prompt can be copied."""
        rid, client = self.replicas.place(call.request_id, near=call.share_prefix_of)
        try:
            if call.share_prefix_of and self.replicas.placed(call.share_prefix_of) != (rid, client):
                call = dataclasses.replace(call, share_prefix_of="")  # the sibling is elsewhere (or gone)
            return await client.prefill(call)
        except TierUnavailableError as error:
            self._lost(rid, client, error)
            raise

    async def verify(self, call: VerifyCall) -> Verified:
        placed = self.replicas.placed(call.request_id)
        if placed is None:
            raise TierUnavailableError(f"request {call.request_id}: its verifier replica left the pool")
        rid, client = placed
        try:
            return await client.verify(call)
        except _LOST as error:
            if isinstance(error, TierUnavailableError):
                self._lost(rid, client, error)
            raise


    def engine_of(self, request_id: str) -> str | None:
        """The board key (address) of the replica this request is on, if it is placed."""
        placed = self.replicas.placed(request_id)
        return None if placed is None else self.replicas.member(placed[0]).address

    async def profile(self) -> VerifierProfile:
        """The first healthy replica's profile (replicas of one pool run the same model on the same hardware)."""
        healthy = self.replicas.healthy()
        if not healthy:
            raise TierUnavailableError("no verifier replica yet")
        return await self.replicas.client(healthy[0]).profile()


class PooledDrafter(_Pooled):
    async def open(self, call: OpenCall) -> None:
        old = self.replicas.placed(call.request_id)
        if old is not None:  # reopening: the old context may still exist there
            self.replicas.unplace(call.request_id)
            with contextlib.suppress(Exception):
                await old[1].release(call.request_id)
        rid, client = self.replicas.place(call.request_id)
        try:
            await client.open(call)
        except TierUnavailableError as error:
            self._lost(rid, client, error)
            raise

    async def draft(self, call: DraftCall) -> DraftBlock:
        placed = self.replicas.placed(call.request_id)
        if placed is None:
            raise TierUnavailableError(f"request {call.request_id}: its drafter replica left the pool")
        rid, client = placed
        try:
            return await client.draft(call)
        except TierUnavailableError as error:
            self._lost(rid, client, error)
            raise

    async def ahead(self, call: AheadCall) -> list[Pushed]:
        placed = self.replicas.placed(call.request_id)
        if placed is None:  # the next draft request finds the replica gone
            return []
        return await placed[1].ahead(call)



class Pools:
    """Both pools of one router, refreshed from `discovery` every `interval_s` in the background."""

    def __init__(self, discovery: Discovery, connect_verifier: Callable, connect_drafter: Callable | None,
                 close: Callable[[object], Awaitable[None]], interval_s: float = 0.5, down_s: float = 2.0,
                 metrics: RouterMetrics | None = None):
        self.discovery, self.interval_s, self._close, self.metrics = discovery, interval_s, close, metrics
        self._events_seen = 0
        self.verifiers = ReplicaSet("verifier", connect_verifier, down_s=down_s)
        self.drafters = ReplicaSet("drafter", connect_drafter, down_s=down_s) if connect_drafter else None
        self.verifier = PooledVerifier(self.verifiers)
        self.drafter = PooledDrafter(self.drafters) if self.drafters is not None else None

    async def refresh(self) -> None:
        members = await self.discovery.members()
        stale = self.verifiers.update(members.get("verifier", []))
        if self.drafters is not None:
            stale += self.drafters.update(members.get("drafter", []))
        for client in stale:
            await self._close(client)
        if self.metrics is not None:
            self._export(members)

    def _export(self, members: dict[str, list[Member]]) -> None:
        m = self.metrics
        for role, replicas in members.items():
            m.pool_replicas.labels(m.model, role).set(sum(not r.draining for r in replicas))
        events = getattr(self.discovery, "events", [])
        for e in events[self._events_seen:]:
            direction = "up" if e["after"] > e["before"] else "down"
            m.scale_events.labels(m.model, e["pool"], direction, "manual" if e["reason"] == "dspark scale"
                                  else "autoscaler").inc()
        self._events_seen = len(events)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as error:  # discovery briefly unreachable: keep the pools as they are
                log.warning("pool discovery failed: %s", error)
            await asyncio.sleep(self.interval_s)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the verifier pool (and the drafter pool, if any) has a healthy replica."""
        async with asyncio.timeout(timeout_s):
            while not self.verifiers.healthy() or (self.drafters is not None and not self.drafters.healthy()):
                await self.refresh()
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for client in self.verifiers.clients() + (self.drafters.clients() if self.drafters else []):
            await self._close(client)
