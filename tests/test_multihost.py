"""Deployed as a user would, across hosts ([6/6]): four hosts as network namespaces (tests/netns_hosts.py), `ray
start --head` on A (its GCS kept in a Redis on D), `ray start --address` on B, C and D with a custom resource each,
`dspark serve` on D with the verifier pool placed on B and D and the drafter pool on C by those resources
(tests/host_faults.py: `deploy`), the API reached at D's address, the load board a Redis on D. Every gRPC hop
between hosts is mutual TLS (certificates issued for the hosts' addresses by a test CA): a replica refuses a
plaintext peer and a TLS peer without a client certificate. The replicas serve from their hosts' addresses,
publish their load to D's board, and the served greedy output (DSpark drafting) is plain greedy output, also when
a verifier host dies mid-decode and when the head's host restarts."""

from __future__ import annotations

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from in_process.generation import GenerationRequest, InProcessRouter
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests import host_faults
from tests.conftest import make_engine
from tests.host_faults import BOARD_PORT, MODEL, get, stop
from tests.netns_hosts import Hosts, available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="needs root and iproute2 (the CI machine has both)")]


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


def test_served_across_hosts_through_a_verifier_host_dying_and_the_head_restarting(tmp_path):
    """One deployment as a user would run it (tests/host_faults.py: the Ray head alone on A, its GCS stored in a
    Redis on D; verifiers on B and D, the drafter on C; router, controller and board on D), then two faults.
    Placement: each replica joined from its own host's address. mTLS: a replica refuses a plaintext peer and a
    TLS peer without a client certificate. The board: every replica publishes its load to D's Redis. Served: a
    completion equals plain greedy (bf16, as served). A host dies: eight streamed greedy requests are in flight
    when every process of B is killed at once; each request on B re-prefills on D from its committed tokens. The
    head's host restarts: eight more are in flight when every process of A is killed and, 5 s later, the head
    started again; the GCS reloads the cluster and nothing stops serving. Every request of both ends with plain
    greedy's text, no client error. (One deployment for all of it: a deployment across hosts costs about half a
    minute to start.)"""
    tok = TextTokenizer.from_dir(resolve_model(MODEL))
    engine = make_engine(load_model(resolve_model(MODEL), "auto"), max_len=256)  # the dtype served
    expected = [tok.decode(r.token_ids) for r in InProcessRouter(engine).generate(
        [GenerationRequest(f"p{i}", tok.encode(p), SamplingParams(max_tokens=96), tok.eos_token_ids)
         for i, p in enumerate(host_faults.PROMPTS)])]
    with Hosts(["a", "b", "c", "d"]) as hosts:
        serve, api = host_faults.deploy(hosts, tmp_path)
        try:
            text = (tmp_path / "serve.log").read_text()
            joined = {line.split(" joined at ")[0].rsplit(" ", 1)[1]: line.split(" joined at ")[1].split()[0]
                      for line in text.splitlines() if " replica " in line and " joined at " in line}
            assert {joined["verifier-0"].split(":")[0], joined["verifier-1"].split(":")[0]} == {
                hosts.address["b"], hosts.address["d"]}, joined
            assert joined["drafter-0"].startswith(hosts.address["c"] + ":"), joined
            verifier = joined["verifier-0"].rstrip(",;.")
            tls = hosts.scratch / "tls"
            ca, key, cert = ((tls / name).read_bytes() for name in ("ca.pem", "key.pem", "cert.pem"))
            assert _health(verifier, None) == "UNAVAILABLE"  # a plaintext peer gets no answer
            assert _health(verifier, grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"  # nor one without a cert
            assert _health(verifier, grpc.ssl_channel_credentials(ca, key, cert)) == "SERVING"
            published = redis.Redis(hosts.address[host_faults.ROUTER], BOARD_PORT).keys("*load:*")
            assert any(b":verifier:" in k for k in published) and any(b":drafter:" in k for k in published)
            out = get(api + "/v1/completions", {"model": MODEL, "prompt": host_faults.PROMPTS[0], "max_tokens": 96,
                                                 "temperature": 0}, timeout=120)
            assert out["choices"][0]["text"] == expected[0]
            killed = host_faults.one_fault(hosts, api, "kill", expected, 96, 0.5, tmp_path)
            restarted = host_faults.one_fault(hosts, api, "head-restart", expected, 96, 0.5, tmp_path)
            after = get(api + "/v1/completions", {"model": MODEL, "prompt": host_faults.PROMPTS[1],
                                                   "max_tokens": 96, "temperature": 0}, timeout=120)
            assert after["choices"][0]["text"] == expected[1]  # served on after the head came back
        finally:
            stop(hosts, serve, ["c", "d", "b", "a"])
    assert killed["client_errors"] == [] and killed["wrong"] == [] and killed["lost"] == 0
    assert killed["reprefilled"] > 0  # B held some of them when it died
    assert restarted["client_errors"] == [] and restarted["wrong"] == [] and restarted["lost"] == 0, restarted
    assert restarted["reprefilled"] == 0  # the head is on no request's path
