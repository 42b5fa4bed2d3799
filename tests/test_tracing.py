"""One connected trace per request across router, drafter and verifier (W3C context over real gRPC)."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from drafter_worker.main import drafter_service
from drafter_worker.server import DrafterServicer
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.types import SamplingParams
from tests.tiers import drafter_settings, verifier_settings
from verifier_worker.main import verifier_service
from verifier_worker.server import VerifierServicer


def test_a_request_is_one_trace_across_router_drafter_and_verifier():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def run():
        vs = verifier_service(verifier_settings())
        ds = drafter_service(drafter_settings(drafters=["dspark-target-dspark"]))
        vserver, dserver = GrpcServer("127.0.0.1", 0, ["dspark.v1.Verifier"]), GrpcServer("127.0.0.1", 0, [])
        rpc.add_VerifierServicer_to_server(VerifierServicer(vs, tracer), vserver.server)
        rpc.add_DrafterServicer_to_server(DrafterServicer(ds, tracer), dserver.server)
        for part in (vs, ds, vserver, dserver):
            await part.start()
        verifier, drafter = GrpcVerifier(vserver.address), GrpcDrafter(dserver.address)
        router = Router(verifier, drafter, {"dspark"}, RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)),
                        tracer=tracer)
        async for _ in router.generate(RouterRequest([1, 40, 41, 42], SamplingParams(max_tokens=12))):
            pass
        await verifier.close()
        await drafter.close()
        for server in (vserver, dserver):
            await server.stop(0)
        await vs.stop()
        await ds.stop()

    asyncio.run(run())
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    names = {s.name for s in spans}
    assert {"request", "prefill", "cycle", "draft", "schedule", "verify", "verifier.prefill", "verifier.verify",
            "drafter.open", "drafter.draft"} <= names
    assert len({s.context.trace_id for s in spans}) == 1  # one trace
    root = next(s for s in spans if s.name == "request")
    assert root.parent is None and root.attributes["gen_ai.usage.output_tokens"] == 12
    for server_side, client_side in (("verifier.verify", "verify"), ("drafter.draft", "draft"),
                                     ("verifier.prefill", "prefill")):
        for span in (s for s in spans if s.name == server_side):
            assert by_id[span.parent.span_id].name == client_side  # parented across the process boundary
    cycles = [s for s in spans if s.name == "cycle"]
    assert cycles and all(by_id[s.parent.span_id].name == "request" for s in cycles)
    assert all("dspark.accepted" in s.attributes and "dspark.verify_len" in s.attributes for s in cycles)
