"""GPU placement by construction, proved with Ray's own accounting on a CPU machine: a Ray node started with two
fake GPUs gives two one-GPU replicas different GPUs (each process sees its own as cuda:0), a third waits; and the
id → device rule of every case (cluster/devices.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.devices import replica_device

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("setting", "ids", "visible", "device"), [
    ("cpu", [0], "0", "cpu"),
    ("auto", [], None, "cpu"),  # no GPU given: the CPU, never the node's first GPU
    ("auto", ["1"], "1", "cuda:0"),  # Ray narrowed the view: its GPU is this process's cuda:0
    ("cuda", [3, 2], "3,2", "cuda:0"),  # a replica of two GPUs computes on the first (shards take one each)
    ("cuda", [2], "0,1,2,3", "cuda:2"),  # the whole node visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
    ("cuda", [5], None, "cuda:5"),
])
def test_the_device_follows_the_gpus_ray_gave(setting, ids, visible, device):
    assert replica_device(setting, ids, visible) == device


@pytest.mark.parametrize(("setting", "message"), [("cuda", "no GPU: set the pool's num_gpus"),
                                                  ("cuda:1", "Ray decides")])
def test_a_device_ray_did_not_give_is_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        replica_device(setting, [], None)


SCRIPT = """
import json, os, sys, ray
from cluster.devices import ray_device
ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_gpus=1, num_cpus=0.1)
class Replica:
    def where(self):
        return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), ray_device("cuda")

# One at a time, each alive before the next is made: with three made at once, Ray 2.60 here now and then never
# tells the driver that one of them is alive (its worker ran the constructor), and calls to it wait forever.
a = Replica.remote()
got = [ray.get(a.where.remote(), timeout=120)]
b = Replica.remote()
got.append(ray.get(b.where.remote(), timeout=120))
c = Replica.remote()
ready, _ = ray.wait([c.where.remote()], timeout=3)
print(json.dumps({"two": got, "third_ran": bool(ready)}), flush=True)
for r in (c, b, a):  # the pending one first: nothing left waiting for a GPU while the instance stops
    ray.kill(r)
ray.shutdown()
"""


def _ray_logs(temp: Path) -> str:
    """The tail of each Ray log of the instance, for a failure's message."""
    return "\n".join(f"== {f.name}\n{f.read_text(errors='replace')[-1500:]}"
                     for f in sorted(temp.glob("ray/session_*/logs/*")) if f.is_file() and f.suffix in (".out", ".err")
                     and f.stat().st_size)


def test_two_one_gpu_replicas_get_different_gpus_and_a_third_waits():
    import os
    import signal
    import tempfile

    from cluster.ray_local import LOOPBACK_ENV

    with tempfile.TemporaryDirectory(prefix="rg", dir="/tmp") as short:  # Ray's socket paths must stay short
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": short,
                                     "HOME": short, LOOPBACK_ENV: "0"})
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the instance it started
            stdout, stderr = proc.communicate()
            pytest.fail(f"the Ray script did not end in 180 s; printed {stdout!r}\n{stderr[-2000:]}\n"
                        f"{_ray_logs(Path(short))}")
        assert proc.returncode == 0, stderr[-2000:] + _ray_logs(Path(short))
    report = json.loads(stdout.strip().splitlines()[-1])
    (ids_a, vis_a, dev_a), (ids_b, vis_b, dev_b) = report["two"]
    assert len(ids_a) == len(ids_b) == 1 and ids_a != ids_b  # different GPUs by Ray's accounting
    assert vis_a == str(ids_a[0]) and vis_b == str(ids_b[0])  # each process sees only its own
    assert dev_a == dev_b == "cuda:0"  # so each computes on the GPU it was given
    assert not report["third_ran"]  # no third GPU: the third replica waits for one
