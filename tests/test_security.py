"""Security: TLS and mTLS between the tiers (real tier processes, certificates made by trustme), Redis ACL
credentials in the board's URL (a real redis-server with infra/redis/redis.conf) and their redaction,
and the loopback defaults of every listener."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import shutil
from pathlib import Path

import grpc
import psutil
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.main import build_parser
from cli.serve import serve_settings
from cluster.launcher import RedisProcess, start_tier, start_tiers, stop_tiers
from cluster.settings import ServeSettings
from drafter_worker.settings import DrafterSettings
from protos.serving import channel
from router.main import build_router, tier_health
from router.session import RouterRequest
from router.settings import RouterSettings
from services.errors import InvalidRequestError
from services.redact import redact_url
from services.registry import resolve_model
from services.settings import load
from services.tls import TlsSettings, read_tls
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.tiers import PROMPTS, TARGET, drafter_settings, plain_greedy, private_redis, verifier_settings
from verifier_worker.settings import VerifierSettings

SERVING = health_pb2.HealthCheckResponse.SERVING
PASSWORD = "board-secret-7f3a"
REDIS_CONF = Path(__file__).resolve().parents[1] / "infra" / "redis" / "redis.conf"


# ---- certificates --------------------------------------------------------------------------------------
def _identity(root: Path, name: str, leaf: trustme.LeafCert) -> tuple[Path, Path]:
    cert, key = root / f"{name}.pem", root / f"{name}.key"
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(cert, append=True)
    leaf.private_key_pem.write_to_path(key)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA with a server certificate (SANs 127.0.0.1, localhost) and a client one; a stranger CA and its client."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(root / "ca.pem")
    other.cert_pem.write_to_path(root / "other-ca.pem")
    server, client = _identity(root, "server", ca.issue_cert("127.0.0.1", "localhost")), \
        _identity(root, "client", ca.issue_cert("router.dspark.test"))
    stranger = _identity(root, "stranger", other.issue_cert("router.dspark.test"))
    return {"ca": root / "ca.pem", "other_ca": root / "other-ca.pem", "server": server, "client": client,
            "stranger": stranger}


def _client_tls(pki, identity: str | None = "client", ca: str = "ca"):
    """A router's TLS material: trusting `ca`, presenting `identity`'s certificate (None: no certificate)."""
    cert, key = pki[identity] if identity else (None, None)
    return read_tls(TlsSettings(cert=cert, key=key, ca=pki[ca], client_auth=identity is not None))


@pytest.fixture(scope="module", params=[False, True], ids=["tls", "mtls"])
def tls_tiers(request, pki):
    """Verifier and drafter processes serving TLS (params: without and with client certificates)."""
    tls = TlsSettings(cert=pki["server"][0], key=pki["server"][1], ca=pki["ca"], client_auth=request.param)
    tiers = start_tiers([("verifier", verifier_settings(tls=tls)), ("drafter", drafter_settings(tls=tls))])
    yield tiers, request.param
    stop_tiers(tiers)


async def _check(address: str, tls) -> int | grpc.StatusCode:
    """The server's health status over a fresh channel, or the status code of the refused call."""
    async with channel(address, tls) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return reply.status


def _health(address: str, tls) -> int | grpc.StatusCode:
    return asyncio.run(_check(address, tls))


# ---- TLS and mTLS between the tiers --------------------------------------------------------------------
def test_router_over_tls_equals_plain_greedy(tls_tiers, pki):
    (verifier, drafter), client_auth = tls_tiers
    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    tls = TlsSettings(ca=pki["ca"], **({"cert": pki["client"][0], "key": pki["client"][1], "client_auth": True}
                                       if client_auth else {}))
    settings = RouterSettings(verifier=verifier.address, drafter=drafter.address, policy="fixed", tls=tls)

    async def run():
        router, _, pools = build_router(settings)
        await pools.refresh()
        await router.start(pools.run)
        try:
            await pools.wait_ready(30)
            requests = [RouterRequest(p, SamplingParams(max_tokens=24), request_id=f"tls-{i}",
                                      stop_token_ids=tok.eos_token_ids) for i, p in enumerate(prompts)]
            outputs = await asyncio.gather(*[_tokens(router, r) for r in requests])
            accepted = router.metrics.num_accepted_tokens.labels(router.metrics.model)._value.get()
            return outputs, await tier_health(pools), accepted
        finally:
            await router.stop()
            await pools.close()

    outputs, health, accepted = asyncio.run(run())
    assert outputs == plain_greedy(prompts, [24] * len(prompts))
    assert health == {"verifier": True, "drafter": True} and accepted > 0  # drafts crossed TLS too


async def _tokens(router, request: RouterRequest) -> list[int]:
    return [t async for chunk in router.generate(request) for t in chunk.token_ids]


def test_plaintext_clients_are_refused(tls_tiers):
    for tier in tls_tiers[0]:
        assert _health(tier.address, None) == grpc.StatusCode.UNAVAILABLE


def test_untrusted_peers_are_refused_and_the_server_stays_healthy(tls_tiers, pki):
    (verifier, drafter), client_auth = tls_tiers
    no_cert = _health(verifier.address, _client_tls(pki, identity=None))
    stranger = _health(verifier.address, _client_tls(pki, "stranger"))
    if client_auth:  # mTLS: a client must present a certificate our CA signed
        assert no_cert == stranger == grpc.StatusCode.UNAVAILABLE
    else:  # TLS: any client that trusts the server is served
        assert no_cert == stranger == SERVING
    # ... and a client must not trust a server its CA did not sign.
    assert _health(verifier.address, _client_tls(pki, ca="other_ca")) == grpc.StatusCode.UNAVAILABLE
    for tier in (verifier, drafter):
        assert tier.process.poll() is None and _health(tier.address, _client_tls(pki)) == SERVING


def test_tiers_listen_on_loopback_only(tls_tiers):
    for tier in tls_tiers[0]:
        process = psutil.Process(tier.process.pid)
        listening = [c.laddr for p in (process, *process.children(recursive=True))
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert tier.address.rsplit(":", 1)[1] in {str(a.port) for a in listening}
        assert all(_loopback(a.ip) for a in listening), listening


def _loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (gRPC binds dual-stack sockets)."""
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_unreadable_certificates_stop_a_tier_at_start(tmp_path, pki, capfd):
    missing = tmp_path / "missing.key"
    with pytest.raises(RuntimeError, match="exited with 2"):
        start_tier("verifier", verifier_settings(tls=TlsSettings(cert=pki["server"][0], key=missing)))
    err = " ".join(capfd.readouterr().err.split())  # the console wraps long lines
    assert f"tls.key {missing}: cannot read" in err
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(InvalidRequestError, match="not a PEM file"):
        read_tls(TlsSettings(ca=tmp_path / "junk.pem"))


def test_tls_settings_are_checked_and_keys_stay_out_of_reprs(pki):
    with pytest.raises(ValueError, match="client_auth needs ca"):
        TlsSettings(cert=pki["client"][0], key=pki["client"][1], client_auth=True)
    with pytest.raises(ValueError, match="cert and key go together"):
        TlsSettings(cert=pki["client"][0])
    with pytest.raises(InvalidRequestError, match="needs cert and key"):
        load(DrafterSettings, None, {"tls": {"ca": str(pki["ca"])}})
    material = read_tls(TlsSettings(cert=pki["server"][0], key=pki["server"][1], ca=pki["ca"]))
    assert b"PRIVATE KEY" in material.key and "PRIVATE KEY" not in repr(material)


def test_one_tls_config_reaches_every_role(pki, tmp_path):
    cert, key = (str(p) for p in pki["server"])
    args = build_parser().parse_args(["serve", "--tls-cert", cert, "--tls-key", key, "--tls-ca", str(pki["ca"]),
                                      "--tls-client-auth"])
    s = serve_settings(args)
    assert s.verifier.tls == s.drafter.tls == s.router.tls == s.tls and s.tls.client_auth
    # The controller and the replica actors get the settings as JSON: TLS survives the trip.
    assert ServeSettings.model_validate(s.model_dump(mode="json")) == s
    config = tmp_path / "serve.yaml"
    config.write_text(f"tls: {{cert: {cert}, key: {key}, ca: {pki['ca']}}}\nrouter: {{tls: {{ca: {pki['ca']}}}}}\n")
    s = serve_settings(build_parser().parse_args(["serve", "--config", str(config), "--tls-server-name", "localhost"]))
    assert s.verifier.tls.cert == Path(cert) and s.router.tls.cert is None  # the router's own section wins
    assert {r.tls.server_name for r in (s.verifier, s.drafter, s.router)} == {"localhost"}
    role = build_parser().parse_args(["verifier", "--tls-cert", cert, "--tls-key", key])
    flags = {k: v for k, v in vars(role).items() if k not in ("command", "config", "address_file")}
    assert load(VerifierSettings, None, flags).tls == TlsSettings(cert=cert, key=key)


# ---- Redis: ACL credentials in the URL, redacted wherever the URL is shown -----------------------------
@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """infra/redis/redis.conf (user default off, user dspark limited to dspark:*) with a known password."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    conf = tmp_path_factory.mktemp("redis") / "redis.conf"
    digest = hashlib.sha256(PASSWORD.encode()).hexdigest()
    conf.write_text(REDIS_CONF.read_text().replace("#CHANGE_ME_SHA256", f"#{digest}"))
    server = RedisProcess(config=conf).start()
    yield server
    server.stop()


def _url(server: RedisProcess, password: str) -> str:
    return f"redis://dspark:{password}@127.0.0.1:{server.port}/0"


def test_a_tier_and_a_router_share_the_board_with_acl_credentials(acl_redis, capfd):
    verifier = start_tier("verifier", verifier_settings(redis_url=_url(acl_redis, PASSWORD)))
    settings = RouterSettings(verifier=verifier.address, drafter=None, redis_url=_url(acl_redis, PASSWORD))

    async def run():
        router, _, pools = build_router(settings)
        await router.start(pools.run)
        try:
            async with asyncio.timeout(20):
                while router.planner.board.fresh(verifier.address) is None:
                    await asyncio.sleep(0.05)
            return router.planner.board.fresh(verifier.address)
        finally:
            await router.stop()
            await pools.close()

    try:
        entry = asyncio.run(run())
    finally:
        verifier.stop()
    assert entry.role == "verifier" and entry.kv_total > 0
    out = "".join(capfd.readouterr())
    assert f"dspark:***@127.0.0.1:{acl_redis.port}" in out and PASSWORD not in out


def test_a_wrong_redis_password_stops_a_tier_and_is_never_shown(acl_redis, capfd, caplog):
    wrong = "wrong-pw-91c2"
    with pytest.raises(RuntimeError, match="exited with 2"):
        start_tier("verifier", verifier_settings(redis_url=_url(acl_redis, wrong)))
    err = " ".join(capfd.readouterr().err.split())
    assert "refused dspark's credentials" in err and f"dspark:***@127.0.0.1:{acl_redis.port}" in err
    assert wrong not in err
    with pytest.raises(InvalidRequestError) as refused:
        build_router(RouterSettings(drafter=None, redis_url=_url(acl_redis, wrong)))
    assert "refused dspark's credentials" in str(refused.value) and wrong not in str(refused.value)
    assert wrong not in caplog.text


def test_redact_url_masks_passwords_only():
    assert redact_url("redis://dspark:s3cret@redis:6379/0") == "redis://dspark:***@redis:6379/0"
    assert redact_url("rediss://:s3cret@[::1]:6380/1") == "rediss://:***@[::1]:6380/1"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert redact_url("unix:///run/redis.sock?db=0&password=s3cret") == "unix:///run/redis.sock?db=0&password=***"
    assert redact_url("redis://u:s3cret@host:port/0").count("s3cret") == 0
    assert "s3cret" not in redact_url("redis://u:s3cret@[::1:6379/0")


# ---- loopback defaults ---------------------------------------------------------------------------------
def test_every_default_listener_is_loopback():
    assert VerifierSettings().host == DrafterSettings().host == RouterSettings().host == "127.0.0.1"
    r = RouterSettings()
    assert r.verifier.startswith("127.0.0.1:") and r.drafter.startswith("127.0.0.1:")
    assert VerifierSettings().tls is None and RouterSettings().tls is None  # plaintext stays the default
    with private_redis() as server:
        listening = [c.laddr for c in psutil.Process(server.process.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
