"""The drafter process's composition root: load the target's embeddings and the drafters, serve gRPC.

`python -m drafter_worker [--config FILE] [--FLAG VALUE ...]` runs one drafter (as `dspark drafter` does).
"""

from __future__ import annotations

import asyncio

from drafter_worker.ahead import RunAhead
from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from drafter_worker.server import DrafterServicer
from drafter_worker.service import DrafterService
from drafter_worker.settings import DrafterSettings
from drafter_worker.speculation import Steering
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer
from protos.tier import RunningTier, open_board, role_tracer, set_threads, start_publisher
from services.batching import compute_thread
from services.embeddings import load_embeddings
from services.errors import InvalidRequestError
from services.model_config import ModelConfig
from services.registry import drafters_of, resolve_model
from services.tls import read_tls


def drafter_service(s: DrafterSettings) -> DrafterService:
    names = s.drafters or drafters_of(s.model)
    if not names:
        raise InvalidRequestError(f"no drafters given and none shipped for {s.model}")
    layers = ModelConfig.from_dir(resolve_model(s.model)).num_hidden_layers
    configs = {name: drafter_config(resolve_model(name), s.drafter_format, layers, s.eagle_aux_layer_convention)
               for name in names}
    taps = {c.tap_layers for c in configs.values()}
    if len(taps) != 1:
        raise InvalidRequestError(f"drafters of one replica must share tap layers, got {sorted(taps)}")
    device = None if s.device == "auto" else s.device
    target = load_embeddings(resolve_model(s.model), s.dtype, device)  # all a drafter reads of its target
    proposers, block_sizes = {}, {}
    for name, cfg in configs.items():
        method = str(cfg.method)
        if method in proposers:
            raise InvalidRequestError(f"two {method} drafters given; a replica hosts one per method")
        model, calibration = load_drafter(name, target, s.dtype, device, s.drafter_format,
                                          s.eagle_aux_layer_convention)
        drafter = Drafter(model, calibration, s.max_q, s.seed, s.compile)
        steering = Steering(s.steer_top, s.steer_factor) if s.steer_top else None
        proposers[method] = RunAhead(drafter, s.ahead_budget, steering) if s.ahead_budget else drafter
        block_sizes[method] = cfg.block_size
    order = sorted(proposers, key=lambda m: m != "dspark")  # dspark first: the default method
    return DrafterService({m: proposers[m] for m in order}, block_sizes, s.batch_window_ms / 1000, lease_s=s.lease_s,
                          fallback_queue=s.ahead_fallback_queue, grammar_dir=resolve_model(s.model))


async def start_drafter(s: DrafterSettings) -> RunningTier:
    set_threads(s.threads, s.cpus)
    tls, board = read_tls(s.tls), open_board(s.redis_url)
    tracer = role_tracer("dspark-drafter", s)
    compute = compute_thread()  # every torch call of this tier on one thread (services/batching.py)
    service = await asyncio.get_running_loop().run_in_executor(compute, drafter_service, s)
    server = GrpcServer(s.host, s.port, ["dspark.v1.Drafter"], tls)
    rpc.add_DrafterServicer_to_server(DrafterServicer(service, tracer), server.server)
    await service.start(compute)
    await server.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.contexts, "queued": load.queued, "step_ms_ema": load.step_ms_ema}

    return RunningTier(server, service.stop, start_publisher(board, "drafter", server, snapshot, []), snapshot)
