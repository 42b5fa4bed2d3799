"""The verifier process's composition root: load the target, build the engine and service, serve gRPC.

`python -m verifier_worker [--config FILE] [--FLAG VALUE ...]` runs one verifier (as `dspark verifier` does).
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from pathlib import Path

import torch

from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import GrpcServer
from protos.tier import RunningTier, open_board, role_tracer, set_threads, start_publisher
from services.batching import compute_thread
from services.loader import load_model
from services.model_config import ModelConfig, default_tap_layers
from services.registry import model_name, resolve_model
from services.tls import read_tls
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import host_sps, profile_sps
from verifier_worker.server import VerifierServicer
from verifier_worker.service import VerifierService
from verifier_worker.settings import VerifierSettings


def verifier_taps(s: VerifierSettings) -> tuple[int, ...]:
    if s.tap_layers is not None:
        return tuple(s.tap_layers)
    return default_tap_layers(ModelConfig.from_dir(resolve_model(s.model)).num_hidden_layers)


def load_target(s: VerifierSettings):
    return load_model(resolve_model(s.model), s.dtype, None if s.device == "auto" else s.device,
                      tap_layers=verifier_taps(s))


def verifier_service(s: VerifierSettings, model=None) -> VerifierService:
    model = model if model is not None else load_target(s)
    engine = Engine(model, EngineConfig(num_slots=s.num_slots, max_len=s.max_len, max_batch_tokens=s.max_batch_tokens,
                                        max_waiting=s.max_waiting, compile=s.compile))
    return VerifierService(engine, model_name(s.model), s.lease_s, s.batch_window_ms / 1000)


def start_profile(s: VerifierSettings, forward) -> list:
    """SPS(B) at start-up: measured, or this host's earlier measurement of the same setup (`profile_cache`)."""
    if not s.profile_cache:
        return profile_sps(forward, context=256, repeats=5)
    model_dir = Path(resolve_model(s.model))
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir()
                   if p.suffix in (".json", ".safetensors"))
    setup = {"model": [str(model_dir.resolve()), files], "dtype": str(forward.dtype), "device": str(forward.device),
             "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)), "compile": s.compile,
             "forward": type(forward).__name__,
             "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}
    return host_sps(forward, setup, context=256, repeats=5)


async def start_verifier(s: VerifierSettings, model=None) -> RunningTier:
    """Load (or take) the target, profile SPS(B), serve dspark.v1.Verifier. `model`: e.g. a TP driver."""
    set_threads(s.threads, s.cpus)
    tls, board = read_tls(s.tls), open_board(s.redis_url)  # before the model loads: bad certificates or credentials
    tracer = role_tracer("dspark-verifier", s)
    compute, loop = compute_thread(), asyncio.get_running_loop()  # every torch call of this tier on one thread
    service = await loop.run_in_executor(compute, verifier_service, s, model)
    sps = await loop.run_in_executor(compute, partial(start_profile, s, service.engine.forward)) if s.profile else []
    server = GrpcServer(s.host, s.port, ["dspark.v1.Verifier"], tls)
    rpc.add_VerifierServicer_to_server(VerifierServicer(service, tracer, sps, server.address), server.server)
    await service.start(compute)
    await server.start()

    def snapshot() -> dict:
        load = service.load()
        return {"running": load.running, "queued": load.waiting, "kv_used": load.kv_used, "kv_total": load.kv_total,
                "step_ms_ema": load.step_ms_ema, "batch_tokens": load.batch_tokens}

    publisher = start_publisher(board, "verifier", server, snapshot, [(p.batch_tokens, p.step_ms) for p in sps])
    return RunningTier(server, service.stop, publisher, snapshot)
