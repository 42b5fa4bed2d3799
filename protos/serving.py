"""What every dspark gRPC server shares: bind, `grpc.health.v1`, graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)
# Sized for the largest messages: prefill features of a long prompt (positions × taps × hidden × 2 bytes).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),  # the client pings every 30 s; the server permits it
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class GrpcServer:
    """A grpc.aio server with health reporting for the given service names."""

    def __init__(self, host: str, port: int, services: list[str]):
        self.server = grpc.aio.server(options=OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.services = ["", *services]  # "" is the whole server
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", ", ".join(self.services[1:]), self.address)

    async def stop(self, grace_s: float = 5.0, before: Callable[[], Awaitable[None]] | None = None) -> None:
        """Report NOT_SERVING, let in-flight calls finish for `grace_s`, then stop."""
        await self.health.enter_graceful_shutdown()
        if before is not None:
            await before()
        await self.server.stop(grace_s)


async def wait_for_signal() -> None:
    """Until SIGTERM or SIGINT reaches this process."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def channel(address: str) -> grpc.aio.Channel:
    """A client channel to a dspark tier with matching message limits and keepalive."""
    return grpc.aio.insecure_channel(address, options=OPTIONS)
