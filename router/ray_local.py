"""Join a Ray cluster, or start a local Ray instance whose every listener is on 127.0.0.1."""

from __future__ import annotations

import os
import sys

from router.serve_config import RaySettings

# Ray 2.60 gives a local node the machine's network address unless this is "0" when `ray` is first
# imported (ray_constants reads it once); then the node, and every port it opens, is 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback() -> None:
    """Call before the first `import ray` of the process (children inherit it)."""
    os.environ[LOOPBACK_ENV] = "0"


def connect(s: RaySettings) -> bool:
    """Join the cluster at `s.address`, or start a local instance on loopback → whether it is local.

    Ray's token authentication stays on (its default in 2.60); the dashboard is not started.
    """
    if s.address:
        import ray

        ray.init(address=s.address, namespace=s.namespace)
        return False
    if "ray" not in sys.modules:
        use_loopback()
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"ray was imported before {LOOPBACK_ENV}=0 was set: a local instance would listen on "
                           "the network; set it in the environment")
    ray.init(num_cpus=s.num_cpus, namespace=s.namespace, include_dashboard=False)
    return True
