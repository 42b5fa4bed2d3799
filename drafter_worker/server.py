"""gRPC shell of the drafter tier: `dspark.v1.Drafter` over a `DrafterService` (docs/design.md §4, §7).

One Draft stream per request. The stream ending because the client cancelled or finished frees the
request's draft context; a rejected message (stale cycle, inconsistent delta) ends the stream with its
status and keeps the context.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import trace

from drafter_worker.service import DrafterService
from protos import codec, validate
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import session_stream
from protos.status import abort_with
from services.calls import AheadCall, DraftCall, OpenCall
from services.errors import InvalidRequestError
from services.tracing import context_from


class DrafterServicer(rpc.DrafterServicer):
    def __init__(self, service: DrafterService, tracer: trace.Tracer | None = None):
        self.service = service
        self.tracer = tracer or trace.NoOpTracer()
        self.streams = 0

    async def Open(self, request: pb.OpenRequest, context: grpc.aio.ServicerContext) -> pb.OpenReply:
        with self.tracer.start_as_current_span("drafter.open", context=context_from(request.traceparent),
                                               attributes={"dspark.request_id": request.request_id}):
            try:
                limits = self.service.limits
                context_ids = validate.token_ids(request.context_ids, limits.vocab_size, "context")
                features = validate.features(request.features, limits.feature_width)
                if request.output_start > len(context_ids):
                    raise InvalidRequestError(f"output_start {request.output_start} is past the context "
                                              f"({len(context_ids)} tokens)")
                n = await self.service.open(OpenCall(validate.request_id(request.request_id), context_ids, features,
                                                     validate.params(request.params), request.cycle, request.method,
                                                     request.traceparent, request.output_start))
            except Exception as error:
                await abort_with(context, error)
            method = request.method or self.service.default_method
            return pb.OpenReply(context_length=n, method=method, block_size=self.service.block_sizes.get(method, 0))

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        self.streams += 1
        try:
            async for reply in session_stream(request_iterator, context, self.service, self._draft_one, "Draft"):
                yield reply
        finally:
            self.streams -= 1

    async def _draft_one(self, msg: pb.DraftRequest) -> tuple[pb.DraftReply | None, Exception | None]:
        if msg.ahead:
            return await self._ahead(msg)
        with self.tracer.start_as_current_span("drafter.draft", context=context_from(msg.traceparent)) as span:
            try:
                block = await self.service.draft(self._draft_call(msg, validate.gamma(msg.gamma)))
            except Exception as error:
                return None, error
            span.set_attributes({"dspark.request_id": msg.request_id, "dspark.cycle": msg.cycle,
                                 "dspark.gamma": msg.gamma, "dspark.drafted": len(block)})
            return pb.DraftReply(request_id=msg.request_id, cycle=msg.cycle, block=codec.block_to_pb(block)), None

    def _draft_call(self, msg: pb.DraftRequest, gamma: int) -> DraftCall:
        """The delta a DraftRequest carries (a draft request's, or a notice's for a pushed block), validated."""
        limits = self.service.limits
        new_ids = validate.token_ids(msg.new_ids, limits.vocab_size, "new")
        features = validate.features(msg.features, limits.feature_width)
        return DraftCall(msg.request_id, msg.cycle, new_ids, msg.feature_start, features, gamma, msg.traceparent)

    async def _ahead(self, msg: pb.DraftRequest) -> tuple[pb.DraftReply | None, Exception | None]:
        """An `ahead` notice → its reply, the blocks pushed (maybe none), as a future: the stream reads the next
        message meanwhile (a draft request must not wait behind drafting ahead); an error only for a malformed
        one."""
        try:
            if not msg.taken and (msg.new_ids or msg.features.ByteSize()):
                raise InvalidRequestError("an ahead notice carries new_ids or features only for a taken block")
            gamma = validate.gamma(msg.gamma)
            accept = validate.acceptance(msg.accept, gamma)
            taken = self._draft_call(msg, 0) if msg.taken else None
            pushed = await self.service.notice(AheadCall(msg.request_id, msg.cycle, gamma, accept, taken))
        except Exception as error:
            return None, error
        return asyncio.ensure_future(_pushed_reply(msg, pushed)), None

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        return pb.ReleaseReply(released=await self.service.release(request.request_id))

    async def Load(self, request: pb.LoadRequest, context) -> pb.DrafterLoadReply:
        load = self.service.load()
        return pb.DrafterLoadReply(contexts=load.contexts, streams=self.streams, queued=load.queued,
                                   step_ms_ema=load.step_ms_ema, steps=load.steps)


async def _pushed_reply(msg: pb.DraftRequest, pushed: asyncio.Future) -> pb.DraftReply:
    return pb.DraftReply(request_id=msg.request_id, cycle=msg.cycle, pushed=codec.pushed_to_pb(await pushed))
