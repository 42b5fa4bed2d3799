"""gRPC clients of the verifier and drafter tiers (the `VerifierTier` / `DrafterTier` protocols).

Each request gets its own bidirectional stream, opened at its first cycle and cancelled on release, so
the server frees the request's KV slot or draft context even if the Release call never arrives. Any
failure of a stream drops it; the next call opens a new one (the server kept the request's state).
Every call has a deadline: unary calls `timeout_s`, each cycle's reply `timeout_s` as well. With `tls`
the channel is TLS (mTLS when the material says client_auth), else plaintext.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import torch

from protos import codec
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import channel
from protos.status import error_from_rpc
from services.calls import AheadCall, DraftCall, OpenCall, PrefillCall, Pushed, VerifyCall
from services.errors import TierUnavailableError
from services.tls import TlsMaterial
from services.types import DraftBlock, Prefilled, Verified, VerifierProfile


class _Stream:
    """A request's bidi stream. Exchanges may overlap (an ahead notice's reply is still due when the next draft
    request goes out): each writes in turn and reads its reply after the replies of the exchanges written
    before it, as the server answers in order."""

    def __init__(self, call: grpc.aio.StreamStreamCall):
        self.call = call
        self._writing = asyncio.Lock()  # FIFO: the order of writes is the order of replies
        self._last: asyncio.Future | None = None  # done once the latest exchange written has read its reply

    async def exchange(self, message):
        async with self._writing:
            before = self._last
            mine = self._last = asyncio.get_running_loop().create_future()
            try:
                await self.call.write(message)
            except BaseException:
                mine.set_result(None)
                raise
        try:
            if before is not None:
                await asyncio.wait([before])  # its reply comes first, and its exchange reads it
            return await self.call.read()
        finally:
            mine.set_result(None)


class _StreamPool:
    """One bidi stream per request id over one channel."""

    def __init__(self, address: str, open_call, timeout_s: float):
        self.address, self.timeout_s, self._open_call = address, timeout_s, open_call
        self._streams: dict[str, _Stream] = {}

    async def exchange(self, request_id: str, message):
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = _Stream(self._open_call())
        try:
            async with asyncio.timeout(self.timeout_s):  # one deadline for the exchange; no task per await
                reply = await stream.exchange(message)
        except grpc.aio.AioRpcError as error:
            self.drop(request_id)
            raise error_from_rpc(error, self.address) from None
        except (TimeoutError, grpc.aio.UsageError, ConnectionError, asyncio.InvalidStateError) as error:
            # InvalidStateError: a write on a stream that already ended (its connection was cut) but whose end
            # no read has seen yet.
            self.drop(request_id)
            raise TierUnavailableError(f"{self.address}: {type(error).__name__}") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # this request was cancelled (its client left)
            # The stream was cancelled under us (its replica left the pool and its client closed): a lost replica.
            self.drop(request_id)
            raise TierUnavailableError(f"{self.address}: stream closed") from None
        if reply is grpc.aio.EOF:
            code, details = await stream.call.code(), await stream.call.details()
            self.drop(request_id)
            raise error_from_rpc(_Failed(code, details), self.address)
        return reply

    def drop(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.call.cancel()

    def close_all(self) -> None:
        for rid in list(self._streams):
            self.drop(rid)


class _Failed(grpc.aio.AioRpcError):
    """A stream that ended without a reply, as an RPC error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def _unary(address: str, call, message, timeout_s: float):
    try:
        return await call(message, timeout=timeout_s)
    except grpc.aio.AioRpcError as error:
        raise error_from_rpc(error, address) from None
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        raise TierUnavailableError(f"{address}: channel closed") from None  # its replica left the pool


class GrpcVerifier:
    def __init__(self, address: str, timeout_s: float = 60.0, feature_dtype: torch.dtype = torch.bfloat16,
                 tls: TlsMaterial | None = None):
        self.address, self.timeout_s = address, timeout_s
        self.feature_dtype = codec.dtype_field(feature_dtype)
        self.channel = channel(address, tls)
        self.stub = rpc.VerifierStub(self.channel)
        self._streams = _StreamPool(address, self.stub.Verify, timeout_s)

    async def prefill(self, call: PrefillCall) -> Prefilled:
        msg = codec.prefill_call_to_pb(call, self.feature_dtype)
        reply = await _unary(self.address, self.stub.Prefill, msg, self.timeout_s)
        return Prefilled(list(reply.emitted), reply.committed, codec.tensor_from_pb(reply.features),
                         codec.logprobs_from_pb(reply.logprobs, reply.HasField("logprobs")),
                         codec.logprobs_from_pb(reply.prompt_logprobs, reply.HasField("prompt_logprobs")),
                         reply.feature_start)

    async def verify(self, call: VerifyCall) -> Verified:
        reply = await self._streams.exchange(call.request_id, codec.verify_call_to_pb(call, self.feature_dtype))
        return Verified(codec.outcome_from_pb(reply), reply.committed)

    def forget(self, request_id) -> None:
        """Cancel the request's stream without waiting on this replica (it is presumed lost)."""
        self._streams.drop(request_id)

    async def release(self, request_id) -> None:
        self._streams.drop(request_id)
        with contextlib.suppress(Exception):  # best effort: the cancelled stream frees the slot anyway
            await self.stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=self.timeout_s)

    async def profile(self) -> VerifierProfile:
        reply = await _unary(self.address, self.stub.Profile, pb.ProfileRequest(), self.timeout_s)
        return VerifierProfile(reply.engine_id or self.address, [(p.batch_tokens, p.step_ms) for p in reply.sps])

    async def load(self) -> pb.LoadReply:
        return await _unary(self.address, self.stub.Load, pb.LoadRequest(), self.timeout_s)

    async def close(self) -> None:
        self._streams.close_all()
        await self.channel.close()


class GrpcDrafter:
    def __init__(self, address: str, timeout_s: float = 10.0, tls: TlsMaterial | None = None):
        self.address, self.timeout_s = address, timeout_s
        self.channel = channel(address, tls)
        self.stub = rpc.DrafterStub(self.channel)
        self._streams = _StreamPool(address, self.stub.Draft, timeout_s)

    async def open(self, call: OpenCall) -> None:
        self._streams.drop(call.request_id)  # a reopened context starts a fresh stream
        await _unary(self.address, self.stub.Open, codec.open_call_to_pb(call), self.timeout_s)

    async def draft(self, call: DraftCall) -> DraftBlock:
        reply = await self._streams.exchange(call.request_id, codec.draft_call_to_pb(call))
        return codec.block_from_pb(reply.block)

    async def ahead(self, call: AheadCall) -> list[Pushed]:
        reply = await self._streams.exchange(call.request_id, codec.ahead_call_to_pb(call))
        return codec.pushed_from_pb(reply.pushed)

    def forget(self, request_id) -> None:
        """Cancel the request's stream without waiting on this replica (it is presumed lost)."""
        self._streams.drop(request_id)

    async def release(self, request_id) -> None:
        self._streams.drop(request_id)
        with contextlib.suppress(Exception):
            await self.stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=self.timeout_s)

    async def load(self) -> pb.DrafterLoadReply:
        return await _unary(self.address, self.stub.Load, pb.LoadRequest(), self.timeout_s)

    async def close(self) -> None:
        self._streams.close_all()
        await self.channel.close()
