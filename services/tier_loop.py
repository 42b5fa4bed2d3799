"""What both tier services share: sessions under one lock, a step loop that batches every session with work
pending, a lease janitor, the lifecycle. The verifier (`verifier_worker/service.py`) and the drafter
(`drafter_worker/service.py`) fill in what a step is and when a session has expired.

The loop: wait for a wake-up, give the rest of the sessions `batch_window_s` to send their part
(`gather_window`, ended early once `_ready()`), then `_steps()`, which runs the model in the compute thread
(`compute`) under `lock`, so session calls land between steps. No gRPC, no Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from services.batching import InlineExecutor, StepTimer, compute_thread, gather_window
from services.errors import TierUnavailableError


class TierLoop:
    role = "tier"

    def __init__(self, lease_s: float, batch_window_s: float):
        self.lease_s, self.batch_window_s = lease_s, batch_window_s
        self._sessions: dict[str, Any] = {}  # request id → the tier's session (each holds a `lease`)
        self._lock = asyncio.Lock()
        self._knocking = 0  # session calls waiting for `_lock` (`_turn`); a compute job may read it
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.timer, self.stopping = StepTimer(), False

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self, compute: Executor | None = None) -> None:
        """`compute`: the thread that already ran this tier's model (loading, warm-up, profile), so that its steps
        run there too (see `services.batching.compute_thread`); None: a new one."""
        self._compute = compute or compute_thread()
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._janitor())]

    async def stop(self) -> None:
        self.stopping = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._on_stop(TierUnavailableError(f"{self.role} is stopping"))
        self._compute.shutdown(wait=False)

    # ---- streams ------------------------------------------------------------------------------
    def attach(self, request_id: str) -> None:
        """A stream now carries this request: it is no longer subject to the lease."""
        if request_id in self._sessions:
            self._sessions[request_id].lease.attach()

    def detach(self, request_id: str) -> None:
        session = self._sessions.get(request_id)
        if session is not None:
            session.lease.detach()

    # ---- for the tiers ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _turn(self):
        """`_lock` for a session call, counted while it waits, so a compute job running under the lock can tell
        that a call is waiting and hand the lock back rather than go on."""
        self._knocking += 1
        try:
            await self._lock.acquire()
        finally:
            self._knocking -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self.stopping:
            raise TierUnavailableError(f"{self.role} is stopping")

    async def compute(self, fn: Callable, *args):
        """`fn(*args)` in the compute thread, timed as one step (not counted when it raises)."""
        t0 = time.perf_counter()
        if isinstance(self._compute, InlineExecutor):  # in process: no future to wrap, no loop turn to wait
            result = fn(*args)
        else:
            result = await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        self.timer.record((time.perf_counter() - t0) * 1000)
        return result

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            await gather_window(self._wake, self._ready, self.batch_window_s)
            self._wake.clear()
            await self._steps()

    async def _janitor(self) -> None:
        """Free sessions no stream has carried for `lease_s` (their router went away before or between streams)."""
        while True:
            await asyncio.sleep(self.lease_s / 4)
            now = time.monotonic()
            async with self._lock:
                for rid, session in list(self._sessions.items()):
                    if self._expired(session, now):
                        self._expire(rid)

    # ---- hooks --------------------------------------------------------------------------------
    def _ready(self) -> bool:
        """Every session has sent its part of the next step: stop waiting for stragglers."""
        raise NotImplementedError

    async def _steps(self) -> None:
        """Run the steps the pending work needs (under `_lock`, the model through `compute`)."""
        raise NotImplementedError

    def _expired(self, session, now: float) -> bool:
        return session.lease.expired(self.lease_s, now)

    def _expire(self, request_id: str) -> None:
        raise NotImplementedError

    def _on_stop(self, reason: BaseException) -> None:
        """Fail whatever still waits on this tier."""
