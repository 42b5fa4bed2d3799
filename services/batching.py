"""Gathering a batch in a tier's step loop without a fixed tick.

Sessions of a router run side by side, so their cycles reach a tier a little apart; stepping on the
first arrival would split one natural batch into several small steps, each paying a full forward.
After the first arrival a loop therefore waits until every session it serves has work queued (then
nothing is lost by waiting) or until a short window has passed (a session busy elsewhere, e.g. still
drafting, must not stall the others).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


async def gather_window(wake: asyncio.Event, complete: Callable[[], bool], window_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window_s
    while not complete():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), remaining)
        except TimeoutError:
            return


def ema(old: float, new: float, alpha: float) -> float:
    """Exponential moving average; 0 means no sample yet, so the first sample is taken as is."""
    return new if old == 0 else (1 - alpha) * old + alpha * new


@dataclass(slots=True)
class StepTimer:
    """Steps taken and an exponential moving average of their duration (what a tier reports as load)."""

    alpha: float = 0.1
    steps: int = 0
    ema_ms: float = 0.0

    def record(self, ms: float) -> None:
        self.steps += 1
        self.ema_ms = ema(self.ema_ms, ms, self.alpha)


def compute_thread() -> ThreadPoolExecutor:
    """One dedicated worker thread for a tier's torch work, with this thread's torch thread count.

    OpenMP's thread count is per native thread, so a fresh pool thread would not inherit
    `torch.set_num_threads` from the caller; one long-lived thread also keeps its OpenMP team warm. Each native
    thread that runs a parallel op gets a team of its own, and an idle team's workers spin before they sleep:
    a tier that loads or profiles its model on one thread and steps on another ran its steps ~25 % slower
    with 2 threads on 2 vCPUs (up to 2× in a served process). So a tier process does all of it here.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-compute",
                              initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))


class InlineExecutor(Executor):
    """Runs each job at once on the calling thread: a tier in the caller's process (`in_process/`) steps its model
    on the caller's thread, so an in-process run pays no thread hop a step and keeps the caller's OpenMP team."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to the awaiting coroutine, as a pool thread would
            future.set_exception(error)
        return future
