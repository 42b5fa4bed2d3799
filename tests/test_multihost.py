"""Deployed as a user would, across hosts ([6/6]): three hosts as network namespaces (tests/netns_hosts.py), `ray
start --head` on A, `ray start --address` on B and C with a custom resource each, `dspark serve` on A with the
verifier pool placed on B and the drafter pool on C by those resources, the API reached at A's address, the load
board a Redis on A. Every gRPC hop between hosts is mutual TLS (certificates issued for the hosts' addresses by a
test CA): a replica refuses a plaintext peer and a TLS peer without a client certificate. The replicas serve from
their hosts' addresses, publish their load to A's board, and the served greedy output (DSpark drafting) is plain
greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from in_process.generation import GenerationRequest, InProcessRouter
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.conftest import make_engine
from tests.netns_hosts import Hosts, available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="needs root and iproute2 (the CI machine has both)")]
VENV = Path(sys.executable).parent
MODEL, PROMPT = "dspark-target", "def fibonacci(n):"
BOARD_PORT = 6390
CONFIG = """
ray: {{address: "{head}:6379"}}
pools:
  verifier: {{replicas: 1, min_replicas: 1, num_cpus: 1, resources: {{verifier_host: 1}}}}
  drafter: {{replicas: 1, min_replicas: 1, num_cpus: 1, resources: {{drafter_host: 1}}}}
router: {{host: "{head}", port: 8000, redis_url: "{board}"}}
verifier: {{redis_url: "{board}"}}
drafter: {{redis_url: "{board}"}}
tls: {{cert: "{tls}/cert.pem", key: "{tls}/key.pem", ca: "{tls}/ca.pem", client_auth: true}}
"""


def _certificates(hosts: Hosts) -> Path:
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


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The replica's health over a plaintext channel (credentials None) or a TLS one → its status, or the RPC error's
    code name."""
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return error.code().name
    finally:
        channel.close()


def _env(hosts: Hosts, host: str) -> dict[str, str]:
    # Not the test process's loopback-only Ray mode; each host its own Ray directory, the machine's HOME (the CPU
    # kernels built once)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    return {**env, "PATH": f"{VENV}:/usr/bin:/bin", "RAY_AUTH_MODE": "disabled",
            "RAY_TMPDIR": str(hosts.scratch / host)}


def _board(hosts: Hosts) -> subprocess.Popen:
    """The load board: a Redis on A's address (no persistence), ended with the hosts."""
    return hosts.run("a", ["redis-server", "--bind", hosts.address["a"], "--port", str(BOARD_PORT), "--save", "",
                           "--appendonly", "no", "--protected-mode", "no"], env=_env(hosts, "a"),
                     stdout=subprocess.DEVNULL)


def _get(url: str, body: dict | None = None, timeout: float = 2.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _deploy(hosts: Hosts, tmp_path: Path, config_text: str, workers: dict[str, str]
            ) -> tuple[subprocess.Popen, str]:
    """`ray start --head` on A, `ray start --address` on each worker host with its resource, `dspark serve --config`
    on A → the serve process and the API's URL, once /health answers."""
    head = hosts.address["a"]
    start = ["ray", "start", "--disable-usage-stats", "--num-cpus=2"]
    hosts.exec("a", [*start, "--head", f"--node-ip-address={head}", "--port=6379", "--include-dashboard=false"],
               env=_env(hosts, "a"), timeout=120)
    for host, resource in workers.items():
        hosts.exec(host, [*start, f"--address={head}:6379", f"--node-ip-address={hosts.address[host]}",
                          f"--resources={json.dumps({resource: 4})}"], env=_env(hosts, host), timeout=120)
    config = hosts.scratch / "a" / "serve.yaml"
    config.write_text(config_text)
    log = (tmp_path / "serve.log").open("w")
    serve = hosts.run("a", ["dspark", "serve", "--config", str(config)], env=_env(hosts, "a"), stdout=log,
                      stderr=subprocess.STDOUT)
    api = f"http://{head}:8000"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and serve.poll() is None:
        try:
            _get(api + "/health")
            return serve, api
        except OSError:
            time.sleep(2)
    raise AssertionError("dspark serve did not come up:\n" + (tmp_path / "serve.log").read_text()[-3000:])


def _stop(hosts: Hosts, serve: subprocess.Popen, names: list[str]) -> None:
    serve.terminate()
    serve.wait(timeout=60)
    for host in names:
        hosts.exec(host, ["ray", "stop", "--force"], env=_env(hosts, host), check=False, timeout=60)


def test_served_across_three_hosts_with_pools_placed_by_resources(tmp_path):
    tok = TextTokenizer.from_dir(resolve_model(MODEL))
    plain = InProcessRouter(make_engine(load_model(resolve_model(MODEL), "auto"), max_len=256)).generate(  # as served
        [GenerationRequest("p", tok.encode(PROMPT), SamplingParams(max_tokens=24))])[0].token_ids
    with Hosts(["a", "b", "c"]) as hosts:
        head = hosts.address["a"]
        tls = _certificates(hosts)
        board = _board(hosts)
        serve, api = _deploy(hosts, tmp_path, CONFIG.format(head=head, board=f"redis://{head}:{BOARD_PORT}", tls=tls),
                             {"b": "verifier_host", "c": "drafter_host"})
        text = (tmp_path / "serve.log").read_text()
        assert f"verifier replica verifier-0 joined at {hosts.address['b']}:" in text
        assert f"drafter replica drafter-0 joined at {hosts.address['c']}:" in text
        out = _get(api + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                   timeout=120)
        assert out["choices"][0]["text"] == tok.decode(plain)
        verifier = text.split("verifier replica verifier-0 joined at ")[1].split()[0].rstrip(",;.")
        ca, key, cert = ((tls / name).read_bytes() for name in ("ca.pem", "key.pem", "cert.pem"))
        assert _health(verifier, None) == "UNAVAILABLE"  # a plaintext peer gets no answer
        assert _health(verifier, grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"  # nor one without a client cert
        assert _health(verifier, grpc.ssl_channel_credentials(ca, key, cert)) == "SERVING"
        published = redis.Redis(head, BOARD_PORT).keys("*load:*")
        assert any(b":verifier:" in k for k in published) and any(b":drafter:" in k for k in published), published
        board.terminate()
        _stop(hosts, serve, ["c", "b", "a"])



def test_a_verifier_host_dies_mid_decode_and_no_request_is_lost(tmp_path):
    """Four hosts (tests/host_faults.py): verifiers on B and D, the drafter on C. Eight streamed greedy requests
    in flight, every process of B killed at once: each request on B re-prefills on D from its committed tokens,
    and every request ends with plain greedy's text (bf16, as served), no client error."""
    from tests import host_faults

    tok = TextTokenizer.from_dir(resolve_model(MODEL))
    engine = make_engine(load_model(resolve_model(MODEL), "auto"), max_len=256)
    expected = [tok.decode(r.token_ids) for r in InProcessRouter(engine).generate(
        [GenerationRequest(f"p{i}", tok.encode(p), SamplingParams(max_tokens=96), tok.eos_token_ids)
         for i, p in enumerate(host_faults.PROMPTS)])]
    with Hosts(["a", "b", "c", "d"]) as hosts:
        _board(hosts)
        serve, api = host_faults.deploy(hosts, tmp_path)
        try:
            row = host_faults.one_fault(hosts, api, "kill", expected, 96, 0.5, tmp_path)
        finally:
            _stop(hosts, serve, ["c", "d", "b", "a"])
    assert row["client_errors"] == [] and row["wrong"] == [] and row["lost"] == 0
    assert row["reprefilled"] > 0  # B held some of them when it died
