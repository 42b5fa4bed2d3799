"""Gathering a batch in a tier's step loop without a fixed tick.

Sessions of a router run side by side, so their cycles reach a tier a little apart; stepping on the
first arrival would split one natural batch into several small steps, each paying a full forward.
After the first arrival a loop therefore waits until every session it serves has work queued (then
nothing is lost by waiting) or until a short window has passed (a session busy elsewhere, e.g. still
drafting, must not stall the others).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def gather_window(wake: asyncio.Event, complete: Callable[[], bool], window_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window_s
    while not complete():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), remaining)
        except TimeoutError:
            return
