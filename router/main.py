"""The router process's composition root: pools of tier clients, the router core, the HTTP (and gRPC) fronts."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer
from protos.tier import role_tracer
from router.api.grpc import RouterServicer
from router.api.http import ApiConfig, build_app
from router.router import Router, RouterConfig
from router.scheduling.board_view import BoardView
from router.scheduling.planner import VerifyPlanner
from router.scheduling.policy import Policy
from router.session import Speculation
from router.settings import RouterSettings
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from router.tiers.pooled import Discovery, Pools, StaticDiscovery
from services.load_board import connect_board
from services.registry import model_name, resolve_model
from services.tls import read_tls
from services.tokenizer import TextTokenizer
from services.types import PlainRun


def build_router(s: RouterSettings, tracer=None, discovery: Discovery | None = None,
                 with_drafter: bool | None = None) -> tuple[Router, TextTokenizer, Pools]:
    """The router over pools of verifier and drafter replicas: `discovery` (e.g. the Ray controller) or
    the fixed addresses of the settings. Start `pools.run` with the router (`router.start(pools.run)`)."""
    tls = read_tls(s.tls)  # read once: every replica's channel uses the same material
    model_dir = resolve_model(s.model)
    tokenizer = TextTokenizer.from_dir(model_dir)
    with_drafter = bool(s.drafter) if with_drafter is None else with_drafter
    discovery = discovery or StaticDiscovery(_addresses(s.verifier), _addresses(s.drafter or ""))
    pools = Pools(discovery, partial(GrpcVerifier, timeout_s=s.verifier_timeout_s, tls=tls),
                  partial(GrpcDrafter, timeout_s=s.drafter_timeout_s, tls=tls) if with_drafter else None, _close,
                  down_s=s.replica_down_s)
    policy = Policy(s.policy) if s.method != "none" else Policy.NONE
    default = Speculation(s.method, policy, s.gamma, ahead=s.draft_ahead and s.method != "none")
    config = RouterConfig(default=default, max_gamma=s.max_gamma,
                          threshold=s.threshold, max_running=s.max_running, max_queue=s.max_queue,
                          verifier_retry_s=s.verifier_retry_s,
                          plain=PlainRun(s.plain_depth, s.stream_interval) if s.plain_depth else None,
                          plain_handoff=s.plain_handoff)
    name = s.served_model_name or model_name(s.model)
    board = BoardView(connect_board(s.redis_url), s.board_stale_ms / 1000) if s.redis_url else None
    router = Router(pools.verifier, pools.drafter, set(s.methods), config, tokenizer, tracer, model=name,
                    planner=VerifyPlanner(s.threshold, board, pools.verifier.engine_of,
                                          s.explore_cycles))
    pools.metrics = router.metrics
    return router, tokenizer, pools


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


async def _close(client: GrpcVerifier | GrpcDrafter) -> None:
    await client.close()


async def tier_health(pools: Pools) -> dict[str, bool]:
    """Whether each pool has a replica whose grpc.health.v1 says SERVING, over the router's own channels."""
    async def ok(client: GrpcVerifier | GrpcDrafter) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=1.0)
        except Exception:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def any_ok(clients: list) -> bool:
        return any(await asyncio.gather(*(ok(c) for c in clients)))

    tiers = {"verifier": await any_ok(pools.verifiers.clients())}
    if pools.drafters is not None:
        tiers["drafter"] = await any_ok(pools.drafters.clients())
    return tiers


async def announce(server: uvicorn.Server, address_file: Path) -> None:
    """Write the bound HTTP address once uvicorn serves (how a launcher learns which port 0 became)."""
    while not server.started:
        await asyncio.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    address_file.write_text(f"{host}:{port}")


async def run_router(s: RouterSettings, discovery: Discovery | None = None, with_drafter: bool | None = None,
                     address_file: Path | None = None) -> None:
    tracer = role_tracer("dspark-router", s)
    router, tokenizer, pools = build_router(s, tracer, discovery, with_drafter)
    config = ApiConfig(router.model, s.max_model_len, tuple(s.api_key or ()), s.max_body_bytes, s.sse_keepalive_s,
                       s.strict_fields)
    app = build_app(router, tokenizer, config, lambda: tier_health(pools), tracer)
    server = uvicorn.Server(uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False))
    grpc_server = None
    if s.grpc_port is not None:
        # A client-facing service: its messages are prompts, capped like the HTTP API's bodies.
        grpc_server = GrpcServer("127.0.0.1", s.grpc_port, ["dspark.v1.Router"], max_receive_bytes=s.max_body_bytes)
        rpc.add_RouterServicer_to_server(RouterServicer(router, tokenizer, s.max_model_len), grpc_server.server)
        await grpc_server.start()
    await pools.refresh()
    await router.start(pools.run)
    announced = None if address_file is None else asyncio.create_task(announce(server, address_file))
    try:
        await server.serve()
    finally:
        if announced is not None:
            announced.cancel()
        await router.stop()
        if grpc_server is not None:
            await grpc_server.stop(5.0)
        await pools.close()
