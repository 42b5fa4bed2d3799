"""Hosting one gRPC tier in a process: start its server and service, publish its load, stop on a signal.

Both workers' composition roots (`verifier_worker/main.py`, `drafter_worker/main.py`) and the Ray replica
actors (`cluster/actors.py`) use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from protos.serving import GrpcServer, wait_for_signal
from services import event_loop
from services.errors import DsparkError
from services.tracing import setup_tracing

if TYPE_CHECKING:
    from services.load_board import RedisBoard

log = logging.getLogger(__name__)


def set_threads(n: int, cpus: list[int] | None = None) -> None:
    """torch's CPU threads (0: its default) and, with `cpus`, this process pinned to those CPU ids (as `taskset`
    would; threads default to one per pinned CPU), so two tiers on one host do not take each other's cores."""
    if cpus:
        available = os.sched_getaffinity(0)
        if not set(cpus) <= available:
            raise DsparkError(f"cpus {sorted(set(cpus) - available)} are not available to this process "
                              f"(available: {sorted(available)})")
        os.sched_setaffinity(0, cpus)
        n = n or len(set(cpus))
    if n:
        torch.set_num_threads(n)


def role_tracer(name: str, s) -> object:
    exporter = "otlp" if s.otlp_traces_endpoint else s.traces
    return setup_tracing(name, exporter, s.otlp_traces_endpoint)


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


async def run_tier(start: Awaitable[RunningTier], address_file: Path | None = None) -> None:
    """One tier in this process until SIGTERM/SIGINT (`dspark verifier|drafter`); `address_file` gets the
    bound address once serving (how a launcher learns which port 0 became)."""
    tier = await start
    if address_file is not None:
        address_file.write_text(tier.address)
    await wait_for_signal()
    log.info("shutting down %s", tier.address)
    await tier.stop()


def open_board(url: str | None) -> RedisBoard | None:
    """The load board at `url`, checked (refused credentials stop the tier here), or None without one."""
    if not url:
        return None
    from services.load_board import connect_board  # the Redis client loads only where a board is configured

    board = connect_board(url)
    log.info("load board: %s", board.url)
    return board


def start_publisher(board: RedisBoard | None, role: str, server: GrpcServer, snapshot, sps) -> asyncio.Task | None:
    """Publish this engine's load (keyed by its address) to the board, when one is configured."""
    if board is None:
        return None
    from services.load_board import BoardPublisher

    if sps:
        board.publish_profile(server.address, sps)
    return asyncio.create_task(BoardPublisher(board, server.address, role, snapshot).run())




def tier_main(argv: list[str] | None, settings_type, start, prog: str) -> int:
    """`python -m verifier_worker|drafter_worker`: settings from `--config FILE` and flags, one tier until a signal."""
    import argparse

    from services.settings import add_flags, load

    parser = argparse.ArgumentParser(prog=prog, description=f"run one {prog.split()[-1]} tier (gRPC)")
    parser.add_argument("--config", type=Path, help="YAML whose keys are the flag names below (snake_case)")
    parser.add_argument("--address-file", type=Path, help="write the bound host:port here once serving")
    add_flags(parser, settings_type)
    args = vars(parser.parse_args(argv))
    config, address_file = args.pop("config"), args.pop("address_file")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prog} %(levelname)s %(message)s")
    try:
        event_loop.run(run_tier(start(load(settings_type, config, args)), address_file))
    except (DsparkError, ValueError, FileNotFoundError) as error:  # bad settings, certificates, credentials
        print(f"error: {error}", file=sys.stderr)  # noqa: T201 - the one line a launcher shows its user
        return 2
    return 0
