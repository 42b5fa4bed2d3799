"""How much drafting ahead fits in a verification: the budget sized to the verify window.

Drafting ahead runs in pieces while a block is verified, and a draft request that arrives mid-piece waits for
that piece. The replica times both sides: the window, from an ahead notice to the same request's next draft
request (the verification and two hops), and the cost of one piece. A run starts another piece only while
the time it has used plus one piece stays inside the window, so the last piece does not overrun into the
draft that follows. When a piece costs more than the whole window, a run still probes one piece every
`probe_every` runs, so the estimate follows a load that changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.batching import ema


@dataclass(slots=True)
class AheadWindow:
    alpha: float = 0.2  # weight of the newest sample in both EMAs
    probe_every: int = 16
    window_s: float = 0.0  # notice → next draft request (EMA; 0: no sample yet)
    piece_s: float = 0.0  # one piece of drafting ahead (EMA; 0: no sample yet)
    runs: int = 0

    def observe_window(self, seconds: float) -> None:
        self.window_s = ema(self.window_s, seconds, self.alpha)

    def observe_piece(self, seconds: float) -> None:
        self.piece_s = ema(self.piece_s, seconds, self.alpha)

    def start(self, noticed: float | None = None) -> float:
        """A run begins → the time its window opened: the earliest notice it serves (monotonic seconds)."""
        self.runs += 1
        return time.monotonic() if noticed is None else noticed

    def fits(self, started: float, pieces_done: int, now: float | None = None) -> bool:
        """Whether a run that began at `started` and has drafted `pieces_done` pieces may start another."""
        if not self.window_s or not self.piece_s:
            return True  # nothing measured yet: draft, and measure
        now = time.monotonic() if now is None else now
        if now - started + self.piece_s <= self.window_s:
            return True
        return pieces_done == 0 and self.runs % self.probe_every == 0
