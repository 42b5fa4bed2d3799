"""Errors ↔ gRPC status codes, in one place for every server and client."""

from __future__ import annotations

import logging

import grpc

from services.errors import CapacityError, InvalidRequestError, StaleCycleError, TierUnavailableError

log = logging.getLogger(__name__)
_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StaleCycleError, grpc.StatusCode.FAILED_PRECONDITION),
    (TierUnavailableError, grpc.StatusCode.UNAVAILABLE),
]
# Codes after which the peer is presumed gone (or going): the router recovers rather than failing the request.
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code for an error we raise on purpose; None for anything else (a bug: INTERNAL)."""
    return next((code for cls, code in _CODES if isinstance(error, cls)), None)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End the call with the error's status; unexpected errors become INTERNAL without internals leaked (the
    traceback goes to this server's log instead)."""
    code = status_of(error)
    if code is None:
        log.error("internal error", exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})")
    await context.abort(code, str(error))


def error_from_rpc(error: grpc.aio.AioRpcError, peer: str) -> Exception:
    """A client-side RPC failure → the typed error the router handles."""
    code = error.code()
    for cls, mapped in _CODES:
        if code == mapped:
            return cls(error.details() or code.name)
    if code in _UNAVAILABLE:
        return TierUnavailableError(f"{peer}: {code.name}: {error.details()}")
    return RuntimeError(f"{peer}: {code.name}: {error.details()}")
