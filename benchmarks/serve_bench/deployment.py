"""A running `dspark serve` seen from outside: its processes (RSS), its replicas' live load, its router gauges.

The serve process is whichever process listens on the API's port; its descendants are the local Ray instance
(gcs_server, raylet, Ray's agents) and the Ray workers hosting the replica actors, each labelled by its command
line. Replica addresses come from the deployment's controller actor, as `dspark pools` reads them; the Ray
address to ask is the `--gcs-address` its own Ray processes were started with, so another Ray instance on the
same host is never mistaken for this one. Loads are read over the tiers' `Load` RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock
from urllib.parse import urlparse

import grpc
import httpx
import psutil

from benchmarks.serve_bench.server_metrics import scrape
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import channel

MB = 2**20
ROUTER_GAUGES = {"running": "dspark:num_requests_running", "waiting": "dspark:num_requests_waiting"}
# What a replica's Load reports that must drop to 0 once no request is in flight.
LOAD_FIELDS = {"verifier": ("running", "waiting", "kv_used", "streams"), "drafter": ("contexts", "streams", "queued")}
_SCRIPTS = {"monitor.py": "ray monitor", "log_monitor.py": "ray log_monitor", "dashboard.py": "ray dashboard"}


@contextlib.contextmanager
def started(config: Path | None, log: Path) -> Iterator[str]:
    """`dspark serve` on a free port for the run, as `dspark bench` starts it → its base URL.

    RAY_ADDRESS=local: without it a local instance is not what Ray starts when a `ray start` cluster runs on
    this host (it joins that one, and dies with it), since cluster/ray_local.py gives `ray.init` no address.
    """
    from benchmarks.serve_bench.local_server import serve_locally

    log.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {"RAY_ADDRESS": "local"}):  # the child inherits it; this process need not
            base_url = stack.enter_context(serve_locally(config, log))
        yield base_url


def server_process(base_url: str) -> psutil.Process:
    """The process listening on the base URL's port (on this host)."""
    port = urlparse(base_url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise RuntimeError(f"no local process listens on port {port} ({base_url})")


def label(proc: psutil.Process) -> str | None:
    """ray::VerifierReplica, raylet, gcs_server, dspark serve, ray monitor, ...: what a process is (None: gone)."""
    try:
        cmd = proc.cmdline() or [proc.name()]
    except psutil.Error:
        return None
    first = cmd[0].split()[0]  # Ray workers and redis-server rewrite their title into argv[0]
    if first.startswith("ray::"):
        return first.split(".")[0]  # a busy worker's title names the running method: ray::VerifierReplica.ping
    if not first.split("/")[-1].startswith("python"):
        return first.split("/")[-1]
    for i, word in enumerate(cmd[1:], 1):
        if word.endswith(("cli.main", "/dspark")):
            return " ".join(["dspark", *cmd[i + 1:i + 2]])
        if word in ("verifier_worker", "drafter_worker"):  # python -m verifier_worker: what `dspark verifier` runs
            return "dspark " + word.removesuffix("_worker")
        if word.endswith(tuple(_SCRIPTS)):
            return _SCRIPTS[word.split("/")[-1]]
    return " ".join(w.split("/")[-1] for w in cmd[:2])


def processes(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def rss_mb(procs: list[psutil.Process]) -> dict[int, float]:
    """pid → resident set in MB, for the processes still alive."""
    out = {}
    for proc in procs:
        try:
            out[proc.pid] = proc.memory_info().rss / MB
        except psutil.Error:
            continue
    return out


def gcs_address(procs: list[psutil.Process]) -> str | None:
    """The Ray GCS address the deployment's own Ray processes use (None: it joined a cluster elsewhere)."""
    for proc in procs:
        try:
            words = proc.cmdline()
        except psutil.Error:
            continue
        for word in (w for line in words for w in line.split()):
            if word.startswith("--gcs-address="):
                return word.split("=", 1)[1]
    return None


def replica_addresses(ray_address: str, namespace: str = "dspark") -> dict[str, list[str]]:
    """pool → gRPC addresses of its serving replicas, from the controller's status (a short-lived Ray driver)."""
    from cluster.ray_local import join

    join(ray_address, namespace)
    import ray

    from cluster.controller import CONTROLLER

    try:
        status = ray.get(ray.get_actor(CONTROLLER, namespace=namespace).status.remote(), timeout=60)
    finally:
        ray.shutdown()
    return {pool: [r["address"] for r in p["replicas"] if r["address"]] for pool, p in status["pools"].items()}


@dataclass
class TierLoads:
    """The replicas' `Load` RPCs over channels kept open for the run."""

    replicas: dict[str, list[str]]
    _stubs: dict[str, list[tuple[str, object]]] = field(default_factory=dict)
    _channels: list = field(default_factory=list)

    def __post_init__(self):
        kinds = {"verifier": rpc.VerifierStub, "drafter": rpc.DrafterStub}
        for pool, addresses in self.replicas.items():
            for address in addresses:
                self._channels.append(channel(address))
                self._stubs.setdefault(pool, []).append((address, kinds[pool](self._channels[-1])))

    async def read(self) -> dict[str, list[dict]]:
        """pool → one dict per replica: verifier running / waiting / kv_used / streams, drafter contexts /
        streams / queued; a replica that does not answer reads {"address", "error"}."""
        async def one(address: str, stub) -> dict:
            try:
                reply = await stub.Load(pb.LoadRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:  # an unreachable replica is a reading, not a crash
                return {"address": address, "error": error.code().name}
            pool = "verifier" if isinstance(reply, pb.LoadReply) else "drafter"
            return {"address": address, **{f: getattr(reply, f) for f in LOAD_FIELDS[pool]}}

        return {pool: list(await asyncio.gather(*(one(a, s) for a, s in stubs))) for pool, stubs in self._stubs.items()}

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


def busy(loads: dict[str, list[dict]]) -> dict[str, int]:
    """What should be 0 once no request is in flight: KV slots in use, queued prefills, open draft contexts,
    open streams, summed over replicas (an unreadable replica counts as busy)."""
    out = {}
    for pool, replicas in loads.items():
        for key in LOAD_FIELDS[pool]:
            out[f"{pool}_{key}"] = sum(r.get(key, 0) for r in replicas)
        out[f"{pool}_unreachable"] = sum("error" in r for r in replicas)
    return out


async def router_gauges(http: httpx.AsyncClient) -> dict[str, float]:
    """Requests running and waiting in the router (0 before the first request, when the gauges have no sample);
    {"unreachable": 1} when /metrics does not answer."""
    try:
        flat = scrape((await http.get("/metrics", timeout=10)).raise_for_status().text)
    except httpx.HTTPError:
        return {"unreachable": 1.0}
    return {name: flat.get(key, 0.0) for name, key in ROUTER_GAUGES.items()}
