"""Fault injection for tests: a TCP proxy whose connections can be cut, and process stalls.

`ChaosProxy` sits between the router and a tier on loopback. `cut()` resets every connection open
through it (both sides see the TCP connection drop, as when a network path fails) while new
connections still pass, so a client that reconnects reaches the same, still-running server.
`stalled(pid)` stops a process with SIGSTOP and resumes it with SIGCONT: the process keeps its
sockets and state but answers nothing, as a verifier stuck in a long step or a GC pause would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator


class ChaosProxy:
    """A loopback TCP proxy to `target` ("host:port") in its own thread and event loop."""

    def __init__(self, target: str):
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self.cuts = 0
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result(10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    def cut(self) -> int:
        """Reset every open connection (RST, not FIN: the peers see an error, not an orderly close)."""
        async def reset() -> int:
            writers = list(self._writers)
            for writer in writers:
                sock = writer.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0 makes close() send RST
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                writer.transport.abort()
            self._writers.clear()
            return len(writers)

        cut = asyncio.run_coroutine_threadsafe(reset(), self._loop).result(10)
        self.cuts += cut
        return cut

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def stalled(pid: int) -> Iterator[None]:
    """The process frozen (SIGSTOP) for the block's duration, resumed (SIGCONT) however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
