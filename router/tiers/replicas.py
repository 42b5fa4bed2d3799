"""Pools of tier replicas behind the router: placement, stickiness, failure and draining.

A pool is a set of members (replica id → client of its address) that a discovery source keeps
current: the Ray controller's list of live actors, or a fixed list of addresses. Each request is
placed on one member and stays there (its KV slot or draft context lives there). A member that
fails a call is marked down for `down_s` and its requests are unplaced, so the router's own
recovery (re-prefill from the committed tokens, reopen a draft context) lands elsewhere. A
draining member keeps its requests and takes no new ones. No Ray, no gRPC: clients are injected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.errors import TierUnavailableError

log = logging.getLogger(__name__)
Client = TypeVar("Client")


@dataclass(frozen=True, slots=True)
class Member:
    """One replica as discovery reports it."""

    replica_id: str
    address: str
    draining: bool = False


@dataclass(slots=True)
class _Slot(Generic[Client]):
    member: Member
    client: Client
    down_until: float = 0.0  # monotonic; 0 = healthy
    requests: int = 0  # requests of this router placed here


class ReplicaSet(Generic[Client]):
    def __init__(self, role: str, connect: Callable[[str], Client], close: Callable[[Client], object] | None = None,
                 down_s: float = 2.0):
        self.role, self._connect, self._close, self.down_s = role, connect, close, down_s
        self._slots: dict[str, _Slot[Client]] = {}
        self._placed: dict[str, str] = {}  # request id → replica id
        self._next = 0  # round-robin tie-break

    # ---- membership ---------------------------------------------------------------------------
    def update(self, members: list[Member]) -> list[Client]:
        """Make the pool these members; returns clients of removed or moved members for the caller to close."""
        wanted = {m.replica_id: m for m in members}
        stale, gone = [], set()
        for rid in list(self._slots):
            slot = self._slots[rid]
            member = wanted.get(rid)
            if member is None or member.address != slot.member.address:
                stale.append(self._slots.pop(rid).client)
                gone.add(rid)  # left, or moved: a new process without the requests' state
                if member is None:
                    log.info("%s replica %s left the pool", self.role, rid)
        for rid, member in wanted.items():
            slot = self._slots.get(rid)
            if slot is None:
                self._slots[rid] = _Slot(member, self._connect(member.address))
                log.info("%s replica %s joined at %s", self.role, rid, member.address)
            else:
                slot.member = member
        for request_id, rid in list(self._placed.items()):
            if rid in gone:
                del self._placed[request_id]
        return stale

    def members(self) -> list[Member]:
        return [s.member for s in self._slots.values()]

    def member(self, replica_id: str) -> Member:
        return self._slots[replica_id].member

    def client(self, replica_id: str) -> Client:
        return self._slots[replica_id].client

    def clients(self) -> list[Client]:
        return [s.client for s in self._slots.values()]

    def healthy(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [rid for rid, s in self._slots.items() if s.down_until <= now and not s.member.draining]

    # ---- requests -----------------------------------------------------------------------------
    def place(self, request_id: str, near: str = "") -> tuple[str, Client]:
        """The member serving this request: its current one, else `near`'s when it is healthy, else the
        least-loaded healthy member."""
        current = self._placed.get(request_id)
        if current is not None and current in self._slots:
            return current, self._slots[current].client
        candidates = self.healthy()
        beside = self._placed.get(near) if near else None
        if beside in candidates:
            self._placed[request_id] = beside
            self._slots[beside].requests += 1
            return beside, self._slots[beside].client
        if not candidates:
            raise TierUnavailableError(f"no healthy {self.role} replica ({len(self._slots)} known)")
        self._next += 1
        order = {rid: i for i, rid in enumerate(sorted(candidates))}
        rid = min(candidates, key=lambda r: (self._slots[r].requests,
                                             (order[r] - self._next) % len(candidates)))
        self._placed[request_id] = rid
        self._slots[rid].requests += 1
        return rid, self._slots[rid].client

    def placed(self, request_id: str) -> tuple[str, Client] | None:
        rid = self._placed.get(request_id)
        return None if rid is None or rid not in self._slots else (rid, self._slots[rid].client)

    def unplace(self, request_id: str) -> None:
        rid = self._placed.pop(request_id, None)
        if rid is not None and rid in self._slots:
            self._slots[rid].requests -= 1

    def fail(self, replica_id: str, error: Exception) -> list[str]:
        """A call to this member failed: no new placements on it for `down_s`; its requests move on their
        next call (they would fail there too). → the requests unplaced, whose streams there the caller drops."""
        slot = self._slots.get(replica_id)
        if slot is None:
            return []
        if slot.down_until <= time.monotonic():
            log.warning("%s replica %s marked down: %s", self.role, replica_id, error)
        slot.down_until = time.monotonic() + self.down_s
        moved = [request_id for request_id, rid in self._placed.items() if rid == replica_id]
        for request_id in moved:
            self.unplace(request_id)
        return moved

    def load(self) -> dict[str, int]:
        """Requests of this router per member (the placement's own view)."""
        return {rid: s.requests for rid, s in self._slots.items()}
