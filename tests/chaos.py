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
from collections.abc import Iterator

from benchmarks.net_proxy import NetProxy


class ChaosProxy(NetProxy):
    """A loopback TCP proxy to `target` ("host:port") whose open connections can be reset (a path with no added
    latency or loss: `benchmarks/net_proxy.py` relays the bytes)."""

    def __init__(self, target: str):
        super().__init__(target)
        self.cuts = 0

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


@contextlib.contextmanager
def stalled(pid: int) -> Iterator[None]:
    """The process frozen (SIGSTOP) for the block's duration, resumed (SIGCONT) however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
