"""Faults a cluster has, across hosts ([6/6]): `python -m tests.host_faults` (`make bench-hosts`; root, iproute2).

Four hosts as network namespaces (tests/netns_hosts.py): A runs the Ray head alone, its GCS kept in a Redis on D
(Ray's GCS fault tolerance); B and D a verifier replica each; C the drafter replica; D also `dspark serve` (the
router, the controller pinned to its node) and the Redis load board. For each fault, 8 streamed greedy requests
(DSpark drafts) are in flight when it strikes, each fault on a fresh deployment:

- `partition`: B's link down for 10 s, then up (its requests time out after `verifier_timeout_s` and re-prefill
  on D);
- `kill`: every process of B killed at once (the host dies; D stays);
- `head-restart`: every process of A killed at once, and 5 s later `ray start --head` again on A, as a restarted
  machine's init would (the GCS reloads the cluster from D's Redis; replicas and router never stop serving).

Reported per fault, as JSON: requests lost (ended in an error or with other tokens than plain greedy), client
errors, the slowest request's added stall (its longest gap between two chunks), and p50 / p99 time per output
token. Numbers are printed, never asserted: this is a benchmark of the deployment, not a test of it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import trustme

from in_process.generation import GenerationRequest, InProcessRouter
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.conftest import make_engine
from tests.netns_hosts import Hosts

VENV = Path(sys.executable).parent
MODEL = "dspark-target"
BOARD_PORT = 6390

ROUTER = "d"  # the host of `dspark serve` and both Redis instances: not the head's, which may restart
GCS_PORT = 6391  # the GCS's store (Ray's GCS fault tolerance), a Redis of its own beside the board

PROMPTS = ["def fibonacci(n):", "import os\n\n", "The capital of France is", "class Stack:\n", "for i in range(",
           "SELECT name FROM", "def parse(text):", "Once upon a time"]
CONFIG = """
ray: {{address: "{head}:6379", node_ip_address: "{router}"}}
pools:
  verifier: {{replicas: 2, min_replicas: 2, num_cpus: 1, resources: {{verifier_host: 1}}}}
  drafter: {{replicas: 1, min_replicas: 1, num_cpus: 1, resources: {{drafter_host: 1}}}}
router: {{host: "{router}", port: 8000, redis_url: "{board}", verifier_timeout_s: 3, replica_down_s: 5}}
verifier: {{redis_url: "{board}"}}
drafter: {{redis_url: "{board}"}}
tls: {{cert: "{tls}/cert.pem", key: "{tls}/key.pem", ca: "{tls}/ca.pem", client_auth: true}}
"""


def certificates(hosts: Hosts) -> Path:
    """A test CA and one certificate for every host's address (each end presents it, as server and as client)."""
    ca = trustme.CA()
    cert = ca.issue_cert(*hosts.address.values())
    out = hosts.scratch / "tls"
    out.mkdir()
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    cert.private_key_pem.write_to_path(str(out / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(out / "cert.pem"))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(out / "cert.pem"), append=True)
    return out


def env(hosts: Hosts, host: str) -> dict[str, str]:
    # Not the test process's loopback-only Ray mode; each host its own Ray directory, the machine's HOME (the CPU
    # kernels built once)
    base = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    return {**base, "PATH": f"{VENV}:/usr/bin:/bin", "RAY_AUTH_MODE": "disabled",
            "RAY_TMPDIR": str(hosts.scratch / host)}


def redis_server(hosts: Hosts, host: str, port: int) -> subprocess.Popen:
    """A Redis on `host`'s address (no persistence: it lives as long as its host), ended with the hosts."""
    return hosts.run(host, ["redis-server", "--bind", hosts.address[host], "--port", str(port), "--save", "",
                            "--appendonly", "no", "--protected-mode", "no"], env=env(hosts, host),
                     stdout=subprocess.DEVNULL)


def get(url: str, body: dict | None = None, timeout: float = 2.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def stop(hosts: Hosts, serve: subprocess.Popen, names: list[str]) -> None:
    serve.terminate()
    serve.wait(timeout=60)
    for host in names:
        hosts.exec(host, ["ray", "stop", "--force"], env=env(hosts, host), check=False, timeout=60)


def stream(api: str, prompt: str, tokens: int) -> dict:
    """One streamed completion → its text, chunk arrival times and error (None when it completed)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    text, stamps, started = "", [], time.monotonic()
    try:
        with httpx.stream("POST", api + "/v1/completions", json=body, timeout=120) as reply:
            if reply.status_code != 200:
                return {"text": text, "stamps": stamps, "started": started, "error": f"HTTP {reply.status_code}"}
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"text": text, "stamps": stamps, "started": started, "error": chunk["error"]}
                text += chunk["choices"][0]["text"]
                stamps.append(time.monotonic())
    except httpx.HTTPError as error:
        return {"text": text, "stamps": stamps, "started": started, "error": repr(error)}
    return {"text": text, "stamps": stamps, "started": started, "error": None}


def reprefills(api: str) -> float:
    """The router's count of sessions re-prefilled after losing their verifier (`/metrics`)."""
    text = httpx.get(api + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dspark:verifier_reprefills_total"))


FAULTS = ("none", "partition", "kill", "head-restart")


def one_fault(hosts: Hosts, api: str, fault: str, expected: list[str], tokens: int, delay_s: float,
              out: Path) -> dict:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
    before, extra = reprefills(api), {}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, api, p, tokens) for p in PROMPTS]
        time.sleep(delay_s)  # the requests are mid-decode
        struck = time.monotonic()
        if fault == "none":  # the baseline: the same requests, nothing fails
            pass
        elif fault == "partition":
            hosts.partition("b")
            time.sleep(10)
            hosts.heal("b")
        elif fault == "kill":
            hosts.kill("b")
        elif fault == "head-restart":
            reboot("a", hosts)
            time.sleep(5)
            extra = {"head_back_s": round(start_head(hosts) - struck, 2)}
        results = [f.result() for f in futures]
    if fault == "head-restart":
        extra["cluster_back_s"] = round(cluster_back(hosts) - struck, 2)
    (out / f"{fault}.json").write_text(json.dumps([r["text"] for r in results]))
    wrong = [i for i, (r, want) in enumerate(zip(results, expected, strict=True))
             if r["error"] is None and r["text"] != want]
    errors = [r["error"] for r in results if r["error"] is not None]
    gaps = [max(b - a for a, b in itertools.pairwise(r["stamps"])) for r in results if len(r["stamps"]) > 1]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in results if len(r["stamps"]) > 1]
    return {"fault": fault, "requests": len(results), "lost": len(wrong) + len(errors), "wrong": wrong,
            "client_errors": errors, "reprefilled": reprefills(api) - before,
            "struck_after_s": round(struck - min(r["started"] for r in results), 2),
            "longest_stall_s": round(max(gaps), 2) if gaps else None,
            "tpot_p50_s": round(statistics.median(tpot), 3) if tpot else None,
            "tpot_p99_s": round(max(tpot), 3) if tpot else None, **extra}


RAY_START = ["ray", "start", "--disable-usage-stats", "--num-cpus=2"]


def reboot(host: str, hosts: Hosts) -> None:
    """The host goes down as a restarted machine does: every process killed at once, its temp directory empty
    (Ray's included) when it comes back. Not only for realism: `ray start --head` refuses an address its temp
    directory names while a process on the machine carries `--gcs-address` with it, and the hosts here share
    one process table, where every worker host's raylet carries it."""
    hosts.kill(host)
    shutil.rmtree(hosts.scratch / host)
    (hosts.scratch / host).mkdir()


def start_head(hosts: Hosts) -> float:
    """`ray start --head` on A, its GCS stored in D's Redis → when it returned (monotonic seconds)."""
    head_env = {**env(hosts, "a"), "RAY_REDIS_ADDRESS": f"{hosts.address[ROUTER]}:{GCS_PORT}"}
    hosts.exec("a", [*RAY_START, "--head", f"--node-ip-address={hosts.address['a']}", "--port=6379",
                     "--include-dashboard=false"], env=head_env, timeout=120)
    return time.monotonic()


def cluster_back(hosts: Hosts, timeout_s: float = 120) -> float:
    """Wait until the restarted head knows the cluster again (`ray status` from the router's host lists the
    verifier and drafter nodes) → when (monotonic seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = hosts.exec(ROUTER, ["ray", "status", f"--address={hosts.address['a']}:6379"],
                            env=env(hosts, ROUTER), check=False, timeout=60)
        if status.returncode == 0 and "verifier_host" in status.stdout and "drafter_host" in status.stdout:
            return time.monotonic()
        time.sleep(1)
    raise AssertionError("the restarted head never saw the cluster again")


def deploy(hosts: Hosts, out: Path) -> tuple[subprocess.Popen, str]:
    """The Redis instances on D, the Ray head on A, workers on B, C, D, `dspark serve` on D → (serve, API URL)."""
    redis_server(hosts, ROUTER, BOARD_PORT)  # the load board
    redis_server(hosts, ROUTER, GCS_PORT)
    head, router = hosts.address["a"], hosts.address[ROUTER]
    start_head(hosts)
    for host, resource in (("b", "verifier_host"), ("d", "verifier_host"), ("c", "drafter_host")):
        hosts.exec(host, [*RAY_START, f"--address={head}:6379", f"--node-ip-address={hosts.address[host]}",
                          f"--resources={json.dumps({resource: 1})}"], env=env(hosts, host), timeout=120)
    config = hosts.scratch / ROUTER / "serve.yaml"
    config.write_text(CONFIG.format(head=head, router=router, board=f"redis://{router}:{BOARD_PORT}",
                                    tls=certificates(hosts)))
    log = (out / "serve.log").open("w")
    serve = hosts.run(ROUTER, ["dspark", "serve", "--config", str(config)], env=env(hosts, ROUTER), stdout=log,
                      stderr=subprocess.STDOUT)
    api, deadline = f"http://{router}:8000", time.monotonic() + 300
    while time.monotonic() < deadline and serve.poll() is None:
        log_text = (out / "serve.log").read_text()
        if all(f"verifier replica verifier-{i} joined" in log_text for i in (0, 1)):
            try:
                get(api + "/health")
                return serve, api
            except OSError:
                pass
        time.sleep(2)
    raise SystemExit("dspark serve did not come up:\n" + (out / "serve.log").read_text()[-3000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--delay-s", type=float, default=0.5, help="how long after the requests start the fault strikes")
    p.add_argument("--out", type=Path, default=Path("build/host-faults"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = TextTokenizer.from_dir(resolve_model(MODEL))
    engine = make_engine(load_model(resolve_model(MODEL), "auto"), max_len=256)  # the dtype served
    expected = [tok.decode(r.token_ids) for r in InProcessRouter(engine).generate(
        [GenerationRequest(f"p{i}", tok.encode(prompt), SamplingParams(max_tokens=args.tokens), tok.eos_token_ids)
         for i, prompt in enumerate(PROMPTS)])]
    (args.out / "expected.json").write_text(json.dumps(expected))
    rows = []
    for fault in args.faults.split(","):  # each on a fresh deployment: a fault leaves the pools changed
        with Hosts(["a", "b", "c", "d"]) as hosts:
            serve, api = deploy(hosts, args.out)
            try:
                row = one_fault(hosts, api, fault, expected, args.tokens, args.delay_s, args.out)
                rows.append(row)
                sys.stdout.write(json.dumps(row) + "\n")
                sys.stdout.flush()
            finally:
                stop(hosts, serve, ["c", "d", "b", "a"])
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
