"""Join a Ray cluster, or start a local Ray instance whose every listener is on 127.0.0.1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cluster.settings import RaySettings

# Ray 2.60 gives a local node the machine's network address unless this is "0" when `ray` is first
# imported (ray_constants reads it once); then the node, and every port it opens, is 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_ENV = "RAY_AUTH_MODE"  # "token": Ray's token authentication (~/.ray/auth_token), on by default for local


def use_loopback() -> None:
    """Call before the first `import ray` of the process (children inherit it)."""
    os.environ[LOOPBACK_ENV] = "0"


def _local_address_file() -> Path:
    """Where `dspark serve` leaves the address of the local instance it started (Ray's own
    `ray_current_cluster` is written by `ray start` only)."""
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "dspark_current_cluster"


def join(address: str, namespace: str) -> None:
    """Connect to a running cluster (`dspark scale`, `dspark pools`); "auto" prefers the local instance
    of a `dspark serve` on this host, which is reachable with loopback addressing only."""
    if address == "auto" and _local_address_file().is_file():
        address = _local_address_file().read_text().strip()
    if address.startswith("127.0.0.1") and "ray" not in sys.modules:
        use_loopback()
    if (Path.home() / ".ray" / "auth_token").is_file():  # as `ray` CLI commands do: send the token when there is one
        os.environ.setdefault(AUTH_ENV, "token")
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="warning")


def connect(s: RaySettings) -> bool:
    """Join the cluster at `s.address`, or start a local instance on loopback → whether it is local.

    A local instance uses Ray's token authentication (set on purpose; 2.60 defaults to it) and no dashboard.
    """
    if s.address:
        import ray

        ray.init(address=s.address, namespace=s.namespace, _node_ip_address=s.node_ip_address,
                 log_to_driver=s.log_to_driver)
        return False
    if "ray" not in sys.modules:
        use_loopback()
    os.environ.setdefault(AUTH_ENV, "token")
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"ray was imported before {LOOPBACK_ENV}=0 was set: a local instance would listen on "
                           "the network; set it in the environment")
    # address="local": a new instance even when RAY_ADDRESS or another `ray start` on this host would be joined.
    ray.init(address="local", num_cpus=s.num_cpus, namespace=s.namespace, include_dashboard=False)
    _local_address_file().write_text(ray.get_runtime_context().gcs_address)
    return True


def disconnect(local: bool) -> None:
    import ray

    ray.shutdown()
    if local:
        _local_address_file().unlink(missing_ok=True)
