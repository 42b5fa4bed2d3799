"""`dspark serve` (every role on this host) and `dspark verifier|drafter|router` (one role each)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
from pathlib import Path

from cluster.settings import ServeSettings, check_models, preflight
from cluster.speculative_config import SpeculativeFlags, apply
from drafter_worker.settings import DrafterSettings
from router.settings import RouterSettings
from services import event_loop
from services.errors import InvalidRequestError
from services.settings import add_flags, load, merge, nest
from services.tls import TlsSettings
from verifier_worker.settings import VerifierSettings

ROLES = {"verifier": VerifierSettings, "drafter": DrafterSettings, "router": RouterSettings}
_HELP = {
    "verifier": "serve the target model (dspark.v1.Verifier over gRPC)",
    "drafter": "serve draft models (dspark.v1.Drafter over gRPC)",
    "router": "serve the OpenAI-compatible HTTP API, routing to a verifier and a drafter",
}


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="serve the drafter and verifier pools on Ray and the router's HTTP API")
    serve.add_argument("--config", type=Path, help="YAML with verifier:, drafter:, router:, ray:, pools:, "
                       "autoscaler: sections")
    for flag, kw in (("--address", {"help": "join this Ray cluster (auto, host:port); default: start a local "
                                                "Ray instance on 127.0.0.1"}),
                     ("--verifier-replicas", {"type": int}), ("--drafter-replicas", {"type": int}),
                     ("--tensor-parallel", {"type": int, "help": "shards per verifier replica"}),
                     ("--model", {}), ("--host", {"help": "HTTP bind address"}), ("--port", {"type": int}),
                     ("--method", {}), ("--policy", {}), ("--gamma", {"type": int}),
                     ("--api-key", {"help": "accepted API key (else DSPARK_API_KEY)"}),
                     ("--traces", {"choices": ("none", "console", "otlp")}), ("--otlp-traces-endpoint", {}),
                     ("--redis-url", {"help": "join this load board (redis://[user:password@]host:port/db); "
                                              "default: a private redis-server on loopback when one is on PATH"})):
        serve.add_argument(flag, default=argparse.SUPPRESS, **kw)
    add_flags(serve, TlsSettings, "tls.")  # one TLS config for every gRPC hop of the deployment
    add_flags(serve, SpeculativeFlags)  # vLLM's --speculative-config, SGLang's --speculative-*
    for role, settings in ROLES.items():
        p = sub.add_parser(role, help=_HELP[role])
        p.add_argument("--config", type=Path, help="YAML whose keys are the flag names below (snake_case)")
        p.add_argument("--address-file", type=Path, help=argparse.SUPPRESS)
        add_flags(p, settings)


def _flags(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("command", "config", "address_file")}


def run_role(args: argparse.Namespace) -> int:
    from drafter_worker.main import start_drafter
    from protos.tier import run_tier
    from router.main import run_router
    from verifier_worker.main import start_verifier

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.command} %(levelname)s %(message)s")
    settings = load(ROLES[args.command], args.config, _flags(args))
    if args.command == "verifier":
        event_loop.run(run_tier(start_verifier(settings), args.address_file))
    elif args.command == "drafter":
        event_loop.run(run_tier(start_drafter(settings), args.address_file))
    else:
        event_loop.run(run_router(settings, address_file=args.address_file))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Ray (local on 127.0.0.1, or joined), the controller with both pools as actors, the router here."""
    from cluster.launcher import RedisProcess
    from cluster.ray_local import connect, disconnect

    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    settings = serve_settings(args)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the pools too, as Ctrl-C does
    redis, controller = None, None
    check_models(settings)
    local = connect(settings.ray)  # first: `ray` must not be imported before a local instance is set up
    import ray

    from cluster.controller import RayDiscovery, create
    from router.main import run_router

    try:
        if settings.router.redis_url is None and local and shutil.which("redis-server"):
            redis = RedisProcess().start()  # a private load board for this host, removed on exit
            settings.router.redis_url = redis.url
        settings.verifier.redis_url = settings.drafter.redis_url = settings.router.redis_url
        preflight(settings)
        controller = create(settings)
        members = ray.get(controller.start.remote())
        logging.info("pools ready: %s", {role: len(m) for role, m in members.items()})
        logging.info("OpenAI API on http://%s:%d/v1 (model %s)", settings.router.host, settings.router.port,
                     settings.router.model)
        event_loop.run(run_router(settings.router, RayDiscovery(controller),
                               with_drafter=settings.router.method != "none"))
    except KeyboardInterrupt:
        pass
    finally:
        if controller is not None:
            with contextlib.suppress(Exception):
                ray.get(controller.shutdown.remote(), timeout=30)
        disconnect(local)
        if redis is not None:
            redis.stop()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The file's sections, then `serve`'s flags: model and tracing go to every role, the rest to the router."""
    flags = _flags(args)
    base = load(ServeSettings, args.config, {})
    tls = nest({k: flags.pop(k) for k in list(flags) if k.startswith("tls.")}).get("tls", {})
    ray_flags = {"address": flags.pop("address")} if "address" in flags else {}
    pool_flags = {"verifier": {}, "drafter": {}}
    pool_keys = {"verifier_replicas": ("verifier", "replicas"), "drafter_replicas": ("drafter", "replicas"),
                 "tensor_parallel": ("verifier", "tensor_parallel")}
    for flag, (pool, key) in pool_keys.items():
        if flag in flags:
            pool_flags[pool][key] = flags.pop(flag)
    common = {k: flags.pop(k) for k in ("model", "traces", "otlp_traces_endpoint", "redis_url") if k in flags}
    speculative = {k: flags.pop(k) for k in list(flags) if k.startswith("speculative_")}
    if "api_key" in flags:
        flags["api_key"] = [flags["api_key"]]
    # Replica actors serve gRPC on their Ray node's address and a free port, whatever these say.
    sections = {"verifier": {"port": 0, "host": "127.0.0.1", **common},
                "drafter": {"port": 0, "host": "127.0.0.1", **common}, "router": {**flags, **common}}
    # The file's top-level tls: is already in every role section that had none; the flags change it everywhere.
    merged = {name: merge(getattr(base, name).model_dump(exclude_unset=True), {**extra, "tls": tls} if tls else extra)
              for name, extra in sections.items()}
    if base.tls is not None or tls:
        merged["tls"] = merge(base.tls.model_dump(exclude_unset=True) if base.tls else {}, tls)
    merged["ray"] = {**base.ray.model_dump(exclude_unset=True), **ray_flags}
    merged["pools"] = {pool: {**getattr(base.pools, pool).model_dump(exclude_unset=True), **extra}
                       for pool, extra in pool_flags.items()}
    merged["autoscaler"] = base.autoscaler.model_dump(exclude_unset=True)
    # The speculative options, the file's overridden by the flags (one family of names at a time), go into
    # the router's and the drafter pool's sections.
    options = speculative or base.model_dump(include=set(SpeculativeFlags.model_fields), exclude_none=True)
    try:
        spec = SpeculativeFlags.model_validate(options).speculative()
    except ValueError as error:  # pydantic's ValidationError is one too
        raise InvalidRequestError(f"speculative options: {error}") from None
    if spec is not None:
        apply(spec, merged["router"], merged["drafter"])
    return load(ServeSettings, None, merged)
