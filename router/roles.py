"""Run one serving role in this process: verifier or drafter (gRPC servers), router (HTTP API)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from drafter_worker.server import DrafterServicer
from drafter_worker.service import DrafterService
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer
from router.board_view import BoardView
from router.grpc_server import RouterServicer
from router.grpc_tiers import GrpcDrafter, GrpcVerifier
from router.http_api import ApiConfig, build_app
from router.planner import VerifyPlanner
from router.policy import Policy
from router.router import Router, RouterConfig
from router.serve_config import DrafterSettings, RouterSettings, VerifierSettings
from router.session import Speculation
from services.errors import InvalidRequestError
from services.load_board import BoardPublisher, RedisBoard
from services.loader import load_model
from services.model_config import ModelConfig
from services.registry import list_models, resolve_model
from services.tokenizer import TextTokenizer
from services.tracing import setup_tracing
from services.training.drafter_data import default_tap_layers
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import profile_sps
from verifier_worker.server import VerifierServicer
from verifier_worker.service import VerifierService

log = logging.getLogger(__name__)


def _threads(n: int) -> None:
    if n:
        torch.set_num_threads(n)


def _tracer(name: str, s) -> object:
    exporter = "otlp" if s.otlp_traces_endpoint else s.traces
    return setup_tracing(name, exporter, s.otlp_traces_endpoint)


def verifier_service(s: VerifierSettings) -> VerifierService:
    model_dir = resolve_model(s.model)
    taps = tuple(s.tap_layers) if s.tap_layers is not None else default_tap_layers(
        ModelConfig.from_dir(model_dir).num_hidden_layers)
    model = load_model(model_dir, s.dtype, None if s.device == "auto" else s.device, tap_layers=taps)
    engine = Engine(model, EngineConfig(num_slots=s.num_slots, max_len=s.max_len, max_batch_tokens=s.max_batch_tokens,
                                        max_waiting=s.max_waiting))
    return VerifierService(engine, model_dir.name, s.lease_s, s.batch_window_ms / 1000)


def drafter_service(s: DrafterSettings) -> DrafterService:
    names = s.drafters or [e.name for e in list_models() if e.target == Path(s.model).name]
    if not names:
        raise InvalidRequestError(f"no drafters given and none shipped for {s.model}")
    configs = {name: drafter_config(resolve_model(name)) for name in names}
    taps = {c.tap_layers for c in configs.values()}
    if len(taps) != 1:
        raise InvalidRequestError(f"drafters of one replica must share tap layers, got {sorted(taps)}")
    device = None if s.device == "auto" else s.device
    target = load_model(resolve_model(s.model), s.dtype, device, tap_layers=taps.pop())
    proposers, block_sizes = {}, {}
    for name, cfg in configs.items():
        method = str(cfg.method)
        if method in proposers:
            raise InvalidRequestError(f"two {method} drafters given; a replica hosts one per method")
        model, calibration = load_drafter(name, target, s.dtype, device)
        proposers[method], block_sizes[method] = Drafter(model, calibration, s.max_q, s.seed), cfg.block_size
    order = sorted(proposers, key=lambda m: m != "dspark")  # dspark first: the default method
    return DrafterService({m: proposers[m] for m in order}, block_sizes, s.batch_window_ms / 1000)


async def run_verifier(s: VerifierSettings, port_file: Path | None = None) -> None:
    _threads(s.threads)
    tracer = _tracer("dspark-verifier", s)
    service = verifier_service(s)
    sps = profile_sps(service.engine.model, context=256, repeats=5) if s.profile else []
    server = GrpcServer(s.host, s.port, ["dspark.v1.Verifier"])
    rpc.add_VerifierServicer_to_server(VerifierServicer(service, tracer, sps, server.address), server.server)
    await service.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.running, "queued": load.waiting, "kv_used": load.kv_used, "kv_total": load.kv_total,
                "step_ms_ema": load.step_ms_ema, "batch_tokens": load.batch_tokens}

    publisher = _publisher(s.redis_url, "verifier", server, snapshot, [(p.batch_tokens, p.step_ms) for p in sps])
    await server.serve_until_signal(service.stop, port_file)
    if publisher is not None:
        publisher.cancel()


async def run_drafter(s: DrafterSettings, port_file: Path | None = None) -> None:
    _threads(s.threads)
    tracer = _tracer("dspark-drafter", s)
    service = drafter_service(s)
    server = GrpcServer(s.host, s.port, ["dspark.v1.Drafter"])
    rpc.add_DrafterServicer_to_server(DrafterServicer(service, tracer), server.server)
    await service.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.contexts, "queued": load.queued, "step_ms_ema": load.step_ms_ema}

    publisher = _publisher(s.redis_url, "drafter", server, snapshot, [])
    await server.serve_until_signal(service.stop, port_file)
    if publisher is not None:
        publisher.cancel()


def _publisher(url: str | None, role: str, server: GrpcServer, snapshot, sps) -> asyncio.Task | None:
    """Publish this engine's load (keyed by its address) to the board at `url`, when one is configured."""
    if not url:
        return None
    board = RedisBoard(url)
    if sps:
        board.publish_profile(server.address, sps)
    return asyncio.create_task(BoardPublisher(board, server.address, role, snapshot).run())


def build_router(s: RouterSettings, tracer=None) -> tuple[Router, TextTokenizer, GrpcVerifier, GrpcDrafter | None]:
    model_dir = resolve_model(s.model)
    tokenizer = TextTokenizer.from_dir(model_dir)
    verifier = GrpcVerifier(s.verifier)
    drafter = GrpcDrafter(s.drafter) if s.drafter else None
    policy = Policy(s.policy) if s.method != "none" else Policy.NONE
    config = RouterConfig(default=Speculation(s.method, policy, s.gamma), max_gamma=s.max_gamma,
                          threshold=s.threshold, max_running=s.max_running, max_queue=s.max_queue)
    name = s.served_model_name or model_dir.name
    board = BoardView(RedisBoard(s.redis_url), s.board_stale_ms / 1000) if s.redis_url else None
    router = Router(verifier, drafter, set(s.methods), config, tokenizer, tracer, model=name,
                    planner=VerifyPlanner(s.threshold, board))
    return router, tokenizer, verifier, drafter


async def tier_health(verifier: GrpcVerifier, drafter: GrpcDrafter | None) -> dict[str, bool]:
    """grpc.health.v1 of each tier, over the router's own channels to them."""
    async def ok(client: GrpcVerifier | GrpcDrafter) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=1.0)
        except Exception:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    tiers = {"verifier": await ok(verifier)}
    if drafter is not None:
        tiers["drafter"] = await ok(drafter)
    return tiers


async def run_router(s: RouterSettings) -> None:
    tracer = _tracer("dspark-router", s)
    router, tokenizer, verifier, drafter = build_router(s, tracer)
    app = build_app(router, tokenizer, ApiConfig(router.model, s.max_model_len, tuple(s.api_key or ())),
                    lambda: tier_health(verifier, drafter), tracer)
    server = uvicorn.Server(uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False))
    grpc_server = None
    if s.grpc_port is not None:
        grpc_server = GrpcServer("127.0.0.1", s.grpc_port, ["dspark.v1.Router"])
        rpc.add_RouterServicer_to_server(RouterServicer(router, tokenizer, s.max_model_len), grpc_server.server)
        await grpc_server.start()
    await router.start()
    try:
        await server.serve()
    finally:
        await router.stop()
        if grpc_server is not None:
            await grpc_server.stop(5.0)
        await verifier.close()
        if drafter is not None:
            await drafter.close()
