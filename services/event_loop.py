"""The event loop every dspark process runs on: uvloop where it is installed (Linux, the default install), else
asyncio's own. One gRPC round trip or SSE chunk is a handful of loop iterations and a wake-up or two; uvloop's
are about twice as fast, which `benchmarks/tier_overhead.py` sees as a shorter hop per tier call."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

try:
    import uvloop
except ImportError:  # another platform: the same code on asyncio's loop
    uvloop = None


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)` on the fastest loop available."""
    if uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)
