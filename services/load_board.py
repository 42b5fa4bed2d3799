"""The load board (docs/design.md §8): every engine publishes its load; routers read it to place and trim.

One key per engine with a TTL (`SET … PX`), carrying a publisher sequence number and wall-clock time;
no pub/sub, which drops messages while a reader reconnects. Readers treat an entry older than
`stale_after_s` as saturated. Redis never sits on a request's critical path: calls have short socket
timeouts, and after a failure a circuit breaker answers "unavailable" (None) without trying again for
`cooldown_s`, so the router falls back to its own estimate of in-flight load. The one exception is
`check` at start: credentials the board refuses are a configuration error, not an outage, and stop the
process with the URL's password masked. `LocalBoard` is the same interface in process, for the
single-process embedded default and for tests of its users.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Protocol

import redis

from services.errors import InvalidRequestError
from services.redact import redact_url

log = logging.getLogger(__name__)
PREFIX = "dspark:"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    engine_id: str
    role: str  # "verifier" | "drafter"
    running: int = 0  # requests holding KV slots / draft contexts
    queued: int = 0  # requests or cycles waiting
    batch_tokens: int = 0  # tokens in the last step
    step_ms_ema: float = 0.0
    kv_used: int = 0
    kv_total: int = 0
    acceptance_ema: float = 0.0
    seq: int = 0  # publisher's sequence number, +1 per publish
    ts: float = 0.0  # publisher's wall-clock time (s since the epoch)

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.ts

    def saturation(self, stale_after_s: float, now: float | None = None) -> float:
        """0 (idle) .. 1 (full); a stale entry counts as saturated."""
        if self.age_s(now) > stale_after_s:
            return 1.0
        return min(1.0, self.kv_used / self.kv_total) if self.kv_total else 0.0


class LoadBoard(Protocol):
    def publish(self, load: EngineLoad, ttl_s: float) -> bool: ...

    def read(self, role: str) -> list[EngineLoad] | None: ...  # None: the board is unavailable

    def publish_profile(self, engine_id: str, points: list[tuple[int, float]]) -> bool: ...

    def profile(self, engine_id: str) -> list[tuple[int, float]] | None: ...


class LocalBoard:
    """In-process board with the same semantics (TTL included)."""

    def __init__(self):
        self._loads: dict[tuple[str, str], tuple[float, EngineLoad]] = {}
        self._profiles: dict[str, list[tuple[int, float]]] = {}

    def publish(self, load: EngineLoad, ttl_s: float) -> bool:
        self._loads[(load.role, load.engine_id)] = (time.monotonic() + ttl_s, load)
        return True

    def read(self, role: str) -> list[EngineLoad]:
        now = time.monotonic()
        return [load for (r, _), (expiry, load) in sorted(self._loads.items()) if r == role and expiry > now]

    def publish_profile(self, engine_id: str, points: list[tuple[int, float]]) -> bool:
        self._profiles[engine_id] = list(points)
        return True

    def profile(self, engine_id: str) -> list[tuple[int, float]] | None:
        return self._profiles.get(engine_id)


class RedisBoard:
    def __init__(self, url: str, timeout_s: float = 0.05, cooldown_s: float = 1.0):
        self.url = redact_url(url)  # the only form of the URL kept: it goes into logs and errors
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                               decode_responses=True)
        except ValueError as error:
            raise InvalidRequestError(f"load board {self.url}: {error}") from None
        self.cooldown_s = cooldown_s
        self._open_until = 0.0  # circuit breaker: no calls before this monotonic time
        self.failures = 0

    def publish(self, load: EngineLoad, ttl_s: float) -> bool:
        key = f"{PREFIX}load:{load.role}:{load.engine_id}"
        return self._call(lambda: self.client.set(key, json.dumps(asdict(load)), px=int(ttl_s * 1000))) is not None

    def read(self, role: str) -> list[EngineLoad] | None:
        def fetch():
            keys = sorted(self.client.scan_iter(match=f"{PREFIX}load:{role}:*", count=100))
            return [EngineLoad(**json.loads(raw)) for raw in self.client.mget(keys) if raw] if keys else []
        return self._call(fetch)

    def publish_profile(self, engine_id: str, points: list[tuple[int, float]]) -> bool:
        return self._call(lambda: self.client.set(f"{PREFIX}sps:{engine_id}", json.dumps(points))) is not None

    def profile(self, engine_id: str) -> list[tuple[int, float]] | None:
        raw = self._call(lambda: self.client.get(f"{PREFIX}sps:{engine_id}"))
        return None if not raw else [(int(b), float(ms)) for b, ms in json.loads(raw)]

    def check(self) -> bool:
        """Is the board there? Refused credentials or commands raise (waiting will not mend them); a board
        that does not answer is only logged, as serving goes on without it."""
        try:
            self.client.ping()
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as error:
            raise InvalidRequestError(f"load board {self.url} refused dspark's credentials: {error} (check the "
                                      "user and password in the URL, and the server's ACL)") from None
        except (redis.RedisError, OSError) as error:
            log.warning("load board %s does not answer (%s); serving on without it until it does", self.url, error)
            return False
        return True

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _call(self, fn):
        """fn() or None; a failure opens the breaker for `cooldown_s`."""
        if not self.available:
            return None
        try:
            return fn()
        except (redis.RedisError, OSError):
            self.failures += 1
            self._open_until = time.monotonic() + self.cooldown_s
            return None


def connect_board(url: str, check_timeout_s: float = 2.0, **kw) -> RedisBoard:
    """A RedisBoard for `url` (`kw`: its timeouts), checked first with a patient timeout: the start-up check
    must not mistake a slow network for an absent board."""
    probe = RedisBoard(url, timeout_s=check_timeout_s)
    try:
        probe.check()
    finally:
        probe.client.close()
    return RedisBoard(url, **kw)


class BoardPublisher:
    """Publishes one engine's load every `interval_s` (TTL `ttl_s`), in a thread so Redis never blocks serving."""

    def __init__(self, board: LoadBoard, engine_id: str, role: str, snapshot, interval_s: float = 0.1,
                 ttl_s: float = 1.0):
        self.board, self.engine_id, self.role, self.snapshot = board, engine_id, role, snapshot
        self.interval_s, self.ttl_s, self.seq = interval_s, ttl_s, 0

    async def run(self) -> None:
        while True:
            self.seq += 1
            load = EngineLoad(self.engine_id, self.role, seq=self.seq, ts=time.time(), **self.snapshot())
            await asyncio.to_thread(self.board.publish, load, self.ttl_s)
            await asyncio.sleep(self.interval_s)
