"""gRPC shell of the verifier tier: `dspark.v1.Verifier` over a `VerifierService` (docs/design.md §4–5).

Each Verify stream carries one request's cycles. When the stream ends because the client cancelled it
or finished, the request's KV slot is freed; when the server rejects a message (stale cycle, bad
block) the stream ends with that status and the request is kept, so the router can reopen a stream.
"""

from __future__ import annotations

import grpc
from opentelemetry import trace

from protos import codec, validate
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import session_stream
from protos.status import abort_with
from services.calls import PrefillCall, VerifyCall
from services.tracing import context_from
from verifier_worker.profile import SpsPoint
from verifier_worker.service import VerifierService


class VerifierServicer(rpc.VerifierServicer):
    def __init__(self, service: VerifierService, tracer: trace.Tracer | None = None,
                 sps: list[SpsPoint] | None = None, engine_id: str = ""):
        self.service, self.sps, self.engine_id = service, sps or [], engine_id
        self.tracer = tracer or trace.NoOpTracer()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        with self.tracer.start_as_current_span("verifier.prefill", context=context_from(request.traceparent),
                                               attributes={"dspark.request_id": request.request_id,
                                                           "gen_ai.usage.input_tokens": len(request.prompt_ids)}):
            try:  # every check before the prefill: a rejected message must not hold a KV slot
                dtype = codec.wire_dtype(request.feature_dtype)
                params = validate.params(request.params)
                done = await self.service.prefill(PrefillCall(
                    validate.request_id(request.request_id), list(request.prompt_ids), params,
                    list(request.resume_ids), request.traceparent, request.share_prefix_of,
                    codec.plain_run_from_pb(request)))
            except Exception as error:
                await abort_with(context, error)
            return pb.PrefillReply(request_id=request.request_id, cycle=0, emitted=done.emitted,
                                   committed=done.committed, features=codec.tensor_to_pb(done.features, dtype),
                                   logprobs=codec.logprobs_to_pb(done.logprobs),
                                   prompt_logprobs=codec.logprobs_to_pb(done.prompt_logprobs),
                                   feature_start=done.feature_start)

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        async for reply in session_stream(request_iterator, context, self.service, self._verify_one, "Verify"):
            yield reply

    async def _verify_one(self, msg: pb.VerifyRequest) -> tuple[pb.VerifyReply | None, Exception | None]:
        with self.tracer.start_as_current_span("verifier.verify", context=context_from(msg.traceparent)) as span:
            try:
                block = validate.draft_block(msg.draft, self.service.engine.model.config.vocab_size)
                dtype = codec.wire_dtype(msg.feature_dtype)
                done = await self.service.verify(VerifyCall(msg.request_id, msg.cycle, block, msg.traceparent,
                                                            codec.plain_run_from_pb(msg)))
            except Exception as error:
                return None, error
            out = done.output
            span.set_attributes({"dspark.request_id": msg.request_id, "dspark.cycle": msg.cycle,
                                 "dspark.verify_len": out.num_drafts, "dspark.accepted": out.num_accepted})
            reply = codec.outcome_to_pb(out, done.committed, dtype)
            reply.cycle = msg.cycle
            return reply, None

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        return pb.ReleaseReply(released=await self.service.release(request.request_id))

    async def Profile(self, request: pb.ProfileRequest, context) -> pb.ProfileReply:
        engine = self.service.engine
        cfg = engine.model.config
        return pb.ProfileReply(
            model=self.service.model_name, vocab_size=cfg.vocab_size, max_len=engine.max_len,
            num_slots=engine.config.num_slots, tap_layers=list(engine.model.tap_layers), hidden_size=cfg.hidden_size,
            sps=[pb.SpsPoint(batch_tokens=p.batch_tokens, step_ms=p.step_ms) for p in self.sps],
            engine_id=self.engine_id,
        )

    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadReply:
        load = self.service.load()
        return pb.LoadReply(running=load.running, waiting=load.waiting, kv_used=load.kv_used,
                            kv_total=load.kv_total, step_ms_ema=load.step_ms_ema, steps=load.steps,
                            streams=load.streams, batch_tokens=load.batch_tokens)
