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
import json, os, ray
from cluster.devices import ray_device
ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_gpus=1, num_cpus=0.1)
class Replica:
    def where(self):
        return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), ray_device("cuda")

a, b, c = Replica.remote(), Replica.remote(), Replica.remote()
got = ray.get([a.where.remote(), b.where.remote()])
ready, _ = ray.wait([c.where.remote()], timeout=3)
print(json.dumps({"two": got, "third_ran": bool(ready)}))
ray.shutdown()
"""


def test_two_one_gpu_replicas_get_different_gpus_and_a_third_waits():
    import tempfile

    from cluster.ray_local import LOOPBACK_ENV

    with tempfile.TemporaryDirectory(prefix="rg", dir="/tmp") as short:  # Ray's socket paths must stay short
        out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=180,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": short,
                                  "HOME": short, LOOPBACK_ENV: "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    (ids_a, vis_a, dev_a), (ids_b, vis_b, dev_b) = report["two"]
    assert len(ids_a) == len(ids_b) == 1 and ids_a != ids_b  # different GPUs by Ray's accounting
    assert vis_a == str(ids_a[0]) and vis_b == str(ids_b[0])  # each process sees only its own
    assert dev_a == dev_b == "cuda:0"  # so each computes on the GPU it was given
    assert not report["third_ran"]  # no third GPU: the third replica waits for one
