"""The device each replica's process computes on, by construction from what Ray gave it.

Ray gives an actor its GPUs (`num_gpus` of its pool; a tensor-parallel shard one each) and, unless told not to,
sets `CUDA_VISIBLE_DEVICES` to them, so inside the process the first one it was given is `cuda:0`. A replica
therefore never names a GPU itself: `cuda` or `auto` with GPUs given → the first of them; `auto` with none → the
CPU (never a GPU Ray did not give it, which would put every replica on the node's first GPU); `cuda` with none →
a start error naming the pool setting to fix.
"""

from __future__ import annotations

from collections.abc import Sequence


def replica_device(setting: str, gpu_ids: Sequence[int | str], visible: str | None) -> str:
    """setting: the tier's `device` (auto, cpu, cuda); gpu_ids: `ray.get_gpu_ids()`; visible: the process's
    CUDA_VISIBLE_DEVICES → the torch device this replica uses."""
    if setting == "cpu":
        return "cpu"
    if setting not in ("auto", "cuda"):
        raise ValueError(f"device {setting!r} in a Ray pool: use auto, cpu or cuda (Ray decides which GPU)")
    if not gpu_ids:
        if setting == "cuda":
            raise ValueError("device cuda but Ray gave this replica no GPU: set the pool's num_gpus")
        return "cpu"
    first = str(gpu_ids[0])
    shown = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if first in shown:  # Ray narrowed the process's view to its GPUs: find the first in that view
        return f"cuda:{shown.index(first)}"
    return f"cuda:{first}"  # the whole node is visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)


def ray_device(setting: str) -> str:
    """`replica_device` for the calling Ray actor."""
    import os

    import ray

    return replica_device(setting, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
