"""Run one serving role in this process: verifier or drafter (gRPC servers), router (HTTP API)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from drafter_worker.server import DrafterServicer
from drafter_worker.service import DrafterService
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer, wait_for_signal
from router.board_view import BoardView
from router.grpc_server import RouterServicer
from router.grpc_tiers import GrpcDrafter, GrpcVerifier
from router.http_api import ApiConfig, build_app
from router.planner import VerifyPlanner
from router.policy import Policy
from router.pooled_tiers import Discovery, Pools, StaticDiscovery
from router.router import Router, RouterConfig
from router.serve_config import DrafterSettings, RouterSettings, VerifierSettings
from router.session import Speculation
from services.errors import InvalidRequestError
from services.load_board import BoardPublisher, RedisBoard, connect_board
from services.loader import load_model
from services.model_config import ModelConfig
from services.registry import list_models, resolve_model
from services.tls import read_tls
from services.tokenizer import TextTokenizer
from services.tracing import setup_tracing
from services.training.drafter_data import default_tap_layers
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import profile_sps
from verifier_worker.server import VerifierServicer
from verifier_worker.service import VerifierService

log = logging.getLogger(__name__)


def set_threads(n: int) -> None:
    if n:
        torch.set_num_threads(n)


def _tracer(name: str, s) -> object:
    exporter = "otlp" if s.otlp_traces_endpoint else s.traces
    return setup_tracing(name, exporter, s.otlp_traces_endpoint)


def verifier_taps(s: VerifierSettings) -> tuple[int, ...]:
    if s.tap_layers is not None:
        return tuple(s.tap_layers)
    return default_tap_layers(ModelConfig.from_dir(resolve_model(s.model)).num_hidden_layers)


def load_target(s: VerifierSettings):
    return load_model(resolve_model(s.model), s.dtype, None if s.device == "auto" else s.device,
                      tap_layers=verifier_taps(s))


def verifier_service(s: VerifierSettings, model=None) -> VerifierService:
    model_dir = resolve_model(s.model)
    model = model if model is not None else load_target(s)
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
    return DrafterService({m: proposers[m] for m in order}, block_sizes, s.batch_window_ms / 1000, lease_s=s.lease_s)


@dataclass
class RunningTier:
    """A tier's gRPC server, its service and its load-board publisher, started; `stop` shuts all down."""

    server: GrpcServer
    stop_service: Callable[[], Awaitable[None]]
    publisher: asyncio.Task | None
    load: Callable[[], dict]  # the snapshot the board gets

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.publisher is not None:
            self.publisher.cancel()
        await self.server.stop(grace_s, self.stop_service)


async def start_verifier(s: VerifierSettings, model=None) -> RunningTier:
    """Load (or take) the target, profile SPS(B), serve dspark.v1.Verifier. `model`: e.g. a TP driver."""
    set_threads(s.threads)
    tls, board = read_tls(s.tls), _board(s.redis_url)  # before the model loads: bad certificates or credentials
    tracer = _tracer("dspark-verifier", s)
    service = await asyncio.to_thread(verifier_service, s, model)
    sps = await asyncio.to_thread(profile_sps, service.engine.model, context=256, repeats=5) if s.profile else []
    server = GrpcServer(s.host, s.port, ["dspark.v1.Verifier"], tls)
    rpc.add_VerifierServicer_to_server(VerifierServicer(service, tracer, sps, server.address), server.server)
    await service.start()
    await server.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.running, "queued": load.waiting, "kv_used": load.kv_used, "kv_total": load.kv_total,
                "step_ms_ema": load.step_ms_ema, "batch_tokens": load.batch_tokens}

    publisher = _publisher(board, "verifier", server, snapshot, [(p.batch_tokens, p.step_ms) for p in sps])
    return RunningTier(server, service.stop, publisher, snapshot)


async def start_drafter(s: DrafterSettings) -> RunningTier:
    set_threads(s.threads)
    tls, board = read_tls(s.tls), _board(s.redis_url)
    tracer = _tracer("dspark-drafter", s)
    service = await asyncio.to_thread(drafter_service, s)
    server = GrpcServer(s.host, s.port, ["dspark.v1.Drafter"], tls)
    rpc.add_DrafterServicer_to_server(DrafterServicer(service, tracer), server.server)
    await service.start()
    await server.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.contexts, "queued": load.queued, "step_ms_ema": load.step_ms_ema}

    return RunningTier(server, service.stop, _publisher(board, "drafter", server, snapshot, []), snapshot)


async def run_tier(start: Awaitable[RunningTier], address_file: Path | None = None) -> None:
    """One tier in this process until SIGTERM/SIGINT (`dspark verifier|drafter`); `address_file` gets the
    bound address once serving (how a launcher learns which port 0 became)."""
    tier = await start
    if address_file is not None:
        address_file.write_text(tier.address)
    await wait_for_signal()
    log.info("shutting down %s", tier.address)
    await tier.stop()


def _board(url: str | None) -> RedisBoard | None:
    """The load board at `url`, checked (refused credentials stop the tier here), or None without one."""
    if not url:
        return None
    board = connect_board(url)
    log.info("load board: %s", board.url)
    return board


def _publisher(board: RedisBoard | None, role: str, server: GrpcServer, snapshot, sps) -> asyncio.Task | None:
    """Publish this engine's load (keyed by its address) to the board, when one is configured."""
    if board is None:
        return None
    if sps:
        board.publish_profile(server.address, sps)
    return asyncio.create_task(BoardPublisher(board, server.address, role, snapshot).run())


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
    config = RouterConfig(default=Speculation(s.method, policy, s.gamma), max_gamma=s.max_gamma,
                          threshold=s.threshold, max_running=s.max_running, max_queue=s.max_queue,
                          verifier_retry_s=s.verifier_retry_s)
    name = s.served_model_name or model_dir.name
    board = BoardView(connect_board(s.redis_url), s.board_stale_ms / 1000) if s.redis_url else None
    router = Router(pools.verifier, pools.drafter, set(s.methods), config, tokenizer, tracer, model=name,
                    planner=VerifyPlanner(s.threshold, board, pools.verifier.engine_of))
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


async def run_router(s: RouterSettings, discovery: Discovery | None = None, with_drafter: bool | None = None) -> None:
    tracer = _tracer("dspark-router", s)
    router, tokenizer, pools = build_router(s, tracer, discovery, with_drafter)
    config = ApiConfig(router.model, s.max_model_len, tuple(s.api_key or ()), s.max_body_bytes)
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
    try:
        await server.serve()
    finally:
        await router.stop()
        if grpc_server is not None:
            await grpc_server.stop(5.0)
        await pools.close()
