"""The router's view of the load board: verifier loads read in the background, never on a request's path.

`run` polls the board every `interval_s` in a worker thread and keeps the last answer. An entry is
fresh while its publisher's `seq` keeps advancing — judged on this router's own clock, so clock skew
between hosts does not matter — and stale once it has not moved for `stale_after_s`. A stale or
missing entry, or a board that does not answer, gives the fallback view: only this router's own
in-flight requests count as the verifier's load.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.scheduling.budget import VerifierView
from services.load_board import EngineLoad, LoadBoard

log = logging.getLogger(__name__)


class BoardView:
    def __init__(self, board: LoadBoard, stale_after_s: float = 0.5, interval_s: float = 0.1):
        self.board, self.stale_after_s, self.interval_s = board, stale_after_s, interval_s
        self._loads: dict[str, tuple[EngineLoad, float]] = {}  # engine → (entry, when its seq last moved)
        self.available = False

    def update(self, loads: list[EngineLoad] | None, now: float) -> None:
        """Take one read of the board (None: the board did not answer)."""
        if loads is None:
            if self.available:
                log.warning("load board unavailable; scheduling from this router's own load")
            self.available = False
            return
        self.available = True
        seen = {}
        for x in loads:
            prev = self._loads.get(x.engine_id)
            seen[x.engine_id] = (x, prev[1] if prev is not None and prev[0].seq == x.seq else now)
        self._loads = seen

    def fresh(self, engine_id: str, now: float | None = None) -> EngineLoad | None:
        now = time.monotonic() if now is None else now
        entry = self._loads.get(engine_id) if self.available else None
        if entry is None or now - entry[1] > self.stale_after_s:
            return None
        return entry[0]

    def view(self, engine_id: str, own_requests: int, now: float | None = None) -> VerifierView:
        """The verifier's load beyond this router's `own_requests`; the fallback view when not fresh."""
        x = self.fresh(engine_id, now)
        if x is None:
            return VerifierView(fallback=True)
        others = max(0, x.running - own_requests)
        beyond_anchor = max(0, x.batch_tokens - x.running) / max(x.running, 1)  # tokens per request past 1
        return VerifierView(others, round(others * beyond_anchor), fallback=False)

    async def run(self) -> None:
        while True:
            loads = await asyncio.to_thread(self.board.read, "verifier")
            self.update(loads, time.monotonic())
            await asyncio.sleep(self.interval_s)
