"""Several choices in one response: best_of ranking, and the streams of n samples or a batch merged into one.

Streamed choices arrive interleaved, each chunk carrying its choice index (OpenAI's and vLLM's shape); the
response starts once every choice has its first chunk, so a refusal (429, 400) still gets its status code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from router.api.responses import Output
from router.api.stream import ChunkFeed
from router.session import Chunk


def best(outputs: list[Output], n: int) -> list[Output]:
    """The n samples with the highest cumulative logprob of their tokens (ties: the earlier sample), in rank order."""
    def score(i: int) -> float:
        lp = outputs[i].logprobs
        return sum(lp.logprobs) if lp is not None else 0.0
    ranked = sorted(range(len(outputs)), key=lambda i: (-score(i), i))
    return [outputs[i] for i in ranked[:n]]


class MergedFeed:
    """Many `ChunkFeed`s read as one stream of (choice index, chunk)."""

    def __init__(self, feeds: list[ChunkFeed]):
        self.feeds = feeds

    async def firsts(self) -> list[Chunk]:
        """Each feed's first chunk; the first failure closes every feed and is raised."""
        try:
            return list(await asyncio.gather(*(f.first() for f in self.feeds)))
        except BaseException:
            await self.close()
            raise

    async def rest(self) -> AsyncIterator[tuple[int, Chunk]]:
        """Later chunks of every feed as they come; a feed's failure is raised (the caller closes the rest)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, feed: ChunkFeed) -> None:
            try:
                async for chunk in feed.rest():
                    queue.put_nowait((index, chunk))
            except Exception as error:
                queue.put_nowait((index, error))
            queue.put_nowait((index, None))

        pumps = [asyncio.create_task(pump(i, f)) for i, f in enumerate(self.feeds)]
        try:
            open_feeds = len(pumps)
            while open_feeds:
                index, item = await queue.get()
                if item is None:
                    open_feeds -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in pumps:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pumps, return_exceptions=True)

    async def close(self) -> None:
        for feed in self.feeds:
            await feed.close()
