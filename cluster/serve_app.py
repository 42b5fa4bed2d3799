"""Ray Serve entry point of a KubeRay RayService: `import_path: cluster.serve_app:app`.

RayService deploys Ray Serve applications, so dspark runs inside one: a single Serve replica, pinned to
the head node, that does what `dspark serve --address auto` does there — the controller with both pools
as Ray actors, and the router's OpenAI-compatible API on `router.host:router.port` (its own uvicorn;
Serve's proxy carries no client traffic). Settings come from the file at $DSPARK_SERVE_CONFIG; secrets
from DSPARK_API_KEY and DSPARK_REDIS_URL (which here beats the file, as `--redis-url` does). Serve's
health checks follow the router: a router that stopped fails `check_health`, and Serve replaces the
replica (controller and pools with it).
Needs Ray Serve (`ray[serve]`, in the rayproject/ray images); the rest of dspark does not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import ray
from ray import serve

from cluster.controller import RayDiscovery, create
from cluster.settings import ServeSettings, preflight
from router.main import run_router
from services.settings import load

DEFAULT_CONFIG = "/home/ray/dspark/cluster.serve.yaml"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
                  health_check_period_s=10, health_check_timeout_s=30)
class DsparkDeployment:
    def __init__(self, config_path: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s serve-app %(levelname)s %(message)s")
        s: ServeSettings = load(ServeSettings, config_path, {})
        # The URL may hold a password: from a Secret through the environment, over the file's placeholder.
        s.router.redis_url = os.environ.get("DSPARK_REDIS_URL") or s.router.redis_url
        s.verifier.redis_url = s.drafter.redis_url = s.router.redis_url
        preflight(s)
        self.controller = create(s)
        ray.get(self.controller.start.remote())  # the constructor runs off Serve's event loop: blocking is fine
        self._router = threading.Thread(target=asyncio.run, name="dspark-router", daemon=True,
                                        args=(run_router(s.router, RayDiscovery(self.controller),
                                                               with_drafter=s.router.method != "none"),))
        self._router.start()

    def check_health(self) -> None:
        if not self._router.is_alive():
            raise RuntimeError("the dspark router stopped")


app = DsparkDeployment.bind(os.environ.get("DSPARK_SERVE_CONFIG", DEFAULT_CONFIG))
