"""A network path in user space: a TCP proxy that adds latency and loss between a client and one server.

The kernel here has no `netem` qdisc, so the delay a link between hosts adds is made by this proxy instead: every
chunk read from one side is written to the other `one_way_s` after it arrived (order kept, so a stream sees a
longer path, not reordering). Loss is modelled as TCP shows it to an application: a lost segment is not missing
data but data late by a retransmission timeout; with probability `loss` a chunk (and, in order, what follows it)
waits `rto_s` more (Linux's minimum RTO is 200 ms). Listens on loopback, or on `host` where a test puts it.

    proxy = NetProxy("127.0.0.1:50051", one_way_s=0.0025, loss=0.01)  # 5 ms round trip, 1 % loss
    ... connect to proxy.address ...
    proxy.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass


@dataclass(slots=True)
class PathStats:
    """What crossed the proxy: chunks carried and chunks held back as lost (then retransmitted)."""

    chunks: int = 0
    lost: int = 0


class NetProxy:
    """A TCP proxy to `target` ("host:port") with `one_way_s` of added latency each way and `loss` per chunk, in
    its own thread and event loop."""

    def __init__(self, target: str, one_way_s: float = 0.0, loss: float = 0.0, rto_s: float = 0.2,
                 host: str = "127.0.0.1", seed: int = 0):
        if one_way_s < 0 or not 0 <= loss < 1 or rto_s < 0:
            raise ValueError(f"one_way_s {one_way_s} and rto_s {rto_s} must be ≥ 0, loss {loss} in [0, 1)")
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.one_way_s, self.loss, self.rto_s = one_way_s, loss, rto_s
        self.stats = PathStats()
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="net-proxy")
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, host, 0), self._loop).result(10)
        self.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"

    def set_path(self, one_way_s: float | None = None, loss: float | None = None) -> None:
        """Change the path for what is read from now on (a link getting slower or lossier mid-run)."""
        if one_way_s is not None:
            self.one_way_s = one_way_s
        if loss is not None:
            self.loss = loss

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._direction(reader, up_writer), self._direction(up_reader, writer))

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: a reader that stamps each chunk with its due time, a writer that delivers in order."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            last_due = 0.0
            while (item := await queue.get()) is not None:
                due, data = item
                due = max(due, last_due)  # in order: nothing overtakes a chunk held back
                last_due = due
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                due = time.monotonic() + self.one_way_s
                self.stats.chunks += 1
                if self.loss and self._random.random() < self.loss:
                    self.stats.lost += 1
                    due += self.rto_s
                queue.put_nowait((due, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await delivering
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for writer in list(self._writers):
                with contextlib.suppress(Exception):
                    writer.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
