"""Ray actor shells of the two pools: each hosts one tier's gRPC server (`verifier_worker/main.py`,
`drafter_worker/main.py`) on its node.

The classes are plain; `cluster/ray_pools.py` makes them actors with each pool's resources. A replica
serves on the Ray node's address (the cluster's private network; 127.0.0.1 on a local instance) and
a free port. `start` is idempotent and `ping` reports whether the server runs, so the controller can
tell a restarted actor (Ray re-ran `__init__`, the server is gone) from a live one and start it again.
A tensor-parallel verifier replica is rank 0 (`VerifierReplica`, which runs the Engine and the gRPC
server) plus `VerifierShard` followers that run the same forwards on their shards in lock step.
"""

from __future__ import annotations

import asyncio
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import ray

from cluster.devices import ray_device
from protos.tier import RunningTier, set_threads

if TYPE_CHECKING:
    from verifier_worker.settings import VerifierSettings

# Shards wait in a collective for rank 0's next call however long the replica stays idle; a rank that dies
# is handled by the controller, which replaces the whole replica, so the timeout only has to outlast idleness.
IDLE_TIMEOUT = timedelta(days=30)


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


class _Replica:
    def __init__(self):
        self._tier: RunningTier | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> RunningTier:
        raise NotImplementedError

    async def start(self) -> str:
        """Serve (once) and return the gRPC address."""
        async with self._lock:
            if self._tier is None:
                self._tier = await self._start()
            return self._tier.address

    def ping(self) -> tuple[int, str | None]:
        """(pid, gRPC address or None while not serving)."""
        return os.getpid(), None if self._tier is None else self._tier.address

    def load(self) -> dict:
        return {} if self._tier is None else self._tier.load()

    def node(self) -> str:
        """The Ray node this replica runs on (placement checks, `dspark pools`)."""
        return ray.get_runtime_context().get_node_id()

    async def stop(self) -> None:
        if self._tier is not None:
            await self._tier.stop(grace_s=1.0)
            self._tier = None


class DrafterReplica(_Replica):
    def __init__(self, settings: dict):
        from drafter_worker.settings import DrafterSettings  # each replica loads its own tier's modules only

        super().__init__()
        self.settings = DrafterSettings.model_validate(settings)

    async def _start(self) -> RunningTier:
        from drafter_worker.main import start_drafter  # here: a drafter replica loads no verifier code

        return await start_drafter(self.settings.model_copy(update={"host": _node_ip(), "port": 0,
                                                                    "device": ray_device(self.settings.device)}))


class VerifierReplica(_Replica):
    """Rank 0 of a verifier replica: the Engine, the gRPC server, and (TP > 1) the driver of the shards."""

    def __init__(self, settings: dict, world: int = 1):
        from verifier_worker.settings import VerifierSettings

        super().__init__()
        self.settings, self.world = VerifierSettings.model_validate(settings), world
        self._group_address: str | None = None
        self._driver = None

    def group_address(self) -> str:
        """Where the shards meet rank 0 to form the process group (a free port on this node)."""
        if self._group_address is None:
            with socket.socket() as sock:
                sock.bind((_node_ip(), 0))
                self._group_address = f"{_node_ip()}:{sock.getsockname()[1]}"
        return self._group_address

    async def _start(self) -> RunningTier:
        from verifier_worker.main import start_verifier  # here: a verifier replica loads no drafter code

        self.settings = self.settings.model_copy(update={"device": ray_device(self.settings.device)})
        if self.world > 1:
            self._driver = await asyncio.to_thread(_sharded, self.settings, 0, self.world, self.group_address())
        return await start_verifier(self.settings.model_copy(update={"host": _node_ip(), "port": 0}), self._driver)

    async def stop(self) -> None:
        await super().stop()
        if self._driver is not None:  # after the engine's last step: the shards return from `follow`
            self._driver.close()
            self._driver = None


class VerifierShard:
    """Rank ≥ 1 of a tensor-parallel verifier replica: follows rank 0's forwards until it closes the group."""

    def __init__(self, settings: dict, rank: int, world: int):
        from verifier_worker.settings import VerifierSettings

        self.settings, self.rank, self.world = VerifierSettings.model_validate(settings), rank, world

    def ping(self) -> int:
        return os.getpid()

    async def follow(self, address: str) -> None:
        from verifier_worker.tensor_parallel import follow

        settings = self.settings.model_copy(update={"device": ray_device(self.settings.device)})  # its own GPU
        model, groups = await asyncio.to_thread(_sharded, settings, self.rank, self.world, address, False)
        await asyncio.to_thread(follow, model, groups.meta)


def _sharded(s: VerifierSettings, rank: int, world: int, address: str, driver: bool = True):
    """This rank's shard of the target, in the replica's process group of `world` ranks meeting at `address`:
    rank 0 gets the driver the Engine runs, the others (model, groups) to follow with. Every rank loads the
    checkpoint and keeps its slice."""
    from verifier_worker.main import load_target
    from verifier_worker.tensor_parallel import TensorParallelDriver, init_group, shard_model

    set_threads(s.threads, s.cpus)
    groups = init_group(rank, world, address, IDLE_TIMEOUT)
    model = shard_model(load_target(s), rank, world, groups.compute)
    return TensorParallelDriver(model, groups.meta) if driver else (model, groups)
