"""What every dspark gRPC server shares: bind (plaintext or TLS), `grpc.health.v1`, graceful shutdown on
SIGTERM/SIGINT; and the client channel that matches it."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.status import abort_with
from services.errors import InvalidRequestError
from services.tls import TlsMaterial

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
    """A grpc.aio server with health reporting for the given service names; TLS (mTLS with
    `tls.client_auth`) when `tls` is given, else plaintext."""

    def __init__(self, host: str, port: int, services: list[str], tls: TlsMaterial | None = None,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES):
        options = [o for o in OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.services = ["", *services]  # "" is the whole server
        bind = f"{host}:{port}"
        self.port = (self.server.add_insecure_port(bind) if tls is None
                     else self.server.add_secure_port(bind, server_credentials(tls)))
        self.address = f"{host}:{self.port}"
        self.scheme = "plaintext" if tls is None else "mTLS" if tls.client_auth else "TLS"

    async def start(self) -> None:
        await self.server.start()
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s (%s)", ", ".join(self.services[1:]), self.address, self.scheme)

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


def server_credentials(tls: TlsMaterial) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise InvalidRequestError("tls: a gRPC server needs cert and key")
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=tls.client_auth)


def channel(address: str, tls: TlsMaterial | None = None) -> grpc.aio.Channel:
    """A client channel to a dspark tier with matching message limits and keepalive; TLS when `tls` is given
    (its cert, if any, goes to servers that ask for one: mTLS)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=OPTIONS)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                               certificate_chain=tls.cert)
    name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.aio.secure_channel(address, credentials, options=OPTIONS + name)


async def session_stream(request_iterator, context: grpc.aio.ServicerContext, service, handle, name: str):
    """The reply stream of a Verify or Draft stream: one request per stream, attached to its session (so its lease
    does not free it) while the stream lasts; `handle(msg)` → (reply, error) per message, one reply each, in the
    order of the messages. Messages are handled one after the other; a reply that is a future (a Draft stream's
    ahead notice: the blocks drafted ahead come later) is written when it resolves, and the messages after it are
    read and handled meanwhile. A message that is rejected ends the stream with its status and changes nothing,
    the request included, and no message after it is handled; any other end of the stream (the client closed or
    went away) releases the request, shielded from the cancellation."""
    attached: str | None = None
    release = True
    replies: asyncio.Queue = asyncio.Queue()  # (reply, error) per message handled, then None

    async def read() -> None:
        nonlocal attached
        try:
            async for msg in request_iterator:
                if attached is None:
                    attached = msg.request_id
                    service.attach(attached)
                if msg.request_id != attached:
                    replies.put_nowait((None, InvalidRequestError(f"one request per {name} stream")))
                    return
                reply, error = await handle(msg)
                replies.put_nowait((reply, error))
                if error is not None:
                    return
        finally:
            replies.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (item := await replies.get()) is not None:
            reply, error = item
            if error is not None:
                release = False
                await abort_with(context, error)
            yield await reply if isinstance(reply, asyncio.Future) else reply
        await reader  # its failure, if any, is the stream's
    finally:
        reader.cancel()
        if attached is not None:
            service.detach(attached)
            if release:
                await asyncio.shield(service.release(attached))
