"""A streamed request's generation, started before the HTTP response is.

A stream's status line goes out with its first event, so whatever refuses the request before its first
token — a full queue (429), no verifier (503), a bad option (400) — must be known by then. `ChunkFeed` runs
the router's generator to completion in a task of its own (one task: its spans open and close in one
context), and the handler awaits the first chunk before it answers; later chunks reach the SSE stream
through a queue. Closing the feed (the client left) cancels the task, which releases the request's tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from router.session import Chunk

_END = object()


class ChunkFeed:
    def __init__(self, chunks: AsyncIterator[Chunk]):
        self._queue: asyncio.Queue = asyncio.Queue()  # unbounded: at most one chunk per generated token
        self._task = asyncio.create_task(self._run(chunks))

    async def _run(self, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self._queue.put_nowait(chunk)
        except Exception as error:  # handed to the reader, which answers it
            self._queue.put_nowait(error)
        finally:
            self._queue.put_nowait(_END)

    async def first(self) -> Chunk:
        """The first chunk; the request's error instead if it failed before one (the feed is then closed)."""
        item = await self._queue.get()
        if not isinstance(item, Chunk):
            await self.close()
            raise item if isinstance(item, Exception) else RuntimeError("the request ended without output")
        return item

    async def rest(self) -> AsyncIterator[Chunk]:
        """Every later chunk; raises the request's error if it failed midway."""
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
