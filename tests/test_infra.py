"""infra/: the manifests parse, agree with each other and with the code. No network, no docker, no cluster."""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.settings import PoolSettings, ServeSettings
from services.load_board import PREFIX, EngineLoad, RedisBoard
from services.settings import load

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
KUBERAY = INFRA / "kuberay"
POOLS = ("verifier", "drafter")
SHELL_OPERATORS = re.compile(r"^[();<>|&]+$")
DSPARK_IMAGE = re.compile(r"^(?:[\w.\-]+(?::\d+)?/)*dspark:(?P<tag>[\w.\-]+)$")
UPSTREAM_IMAGES = (re.compile(r"^redis:\d+\.\d+\.\d+$"), re.compile(r"^otel/opentelemetry-collector:\d+\.\d+\.\d+$"))


# ---------------------------------------------------------------------------------------------- helpers


def _yaml_files() -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml") and "secrets" not in p.parts)


@functools.cache
def _docs(path: Path) -> tuple[dict, ...]:
    return tuple(d for d in yaml.safe_load_all(path.read_text()) if d is not None)


def _kind(path: Path, kind: str) -> list[dict]:
    return [d for d in _docs(path) if d.get("kind") == kind]


def _cluster() -> dict:
    return _docs(INFRA / "cluster.yaml")[0]


def _serve() -> ServeSettings:
    return load(ServeSettings, INFRA / "cluster.serve.yaml", {})


def _ray_cluster_specs() -> list[tuple[str, dict]]:
    """(file name, RayCluster spec) for the RayCluster and the RayService's cluster."""
    specs = [("raycluster.yaml", d["spec"]) for d in _kind(KUBERAY / "raycluster.yaml", "RayCluster")]
    specs += [("rayservice.yaml", d["spec"]["rayClusterConfig"]) for d in _kind(KUBERAY / "rayservice.yaml",
                                                                                  "RayService")]
    assert [name for name, _ in specs] == ["raycluster.yaml", "rayservice.yaml"]
    return specs


def _pod_specs(spec: dict) -> list[tuple[str, dict]]:
    """(group, pod template) of a RayCluster spec: the head, then each worker group."""
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, g["template"]) for name, g in groups]


def _walk(node, key: str):
    """Every value stored under `key` anywhere in a YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, key)


def _shell_lines(script: str) -> list[str]:
    return [line for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def _commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ; & && || | and redirections, comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if SHELL_OPERATORS.match(token):
            if token[0] in "<>" and current and current[-1].isdigit():
                current.pop()  # the fd of 2>&1
            commands.append(current)
            current = [] if token[0] not in "<>" else [">"]  # a redirection's target is not a command
        else:
            current.append(token)
    commands.append(current)
    out = []
    for words in commands:
        while words and (words[0] in ("exec", "nohup", "--", "do", "then") or re.match(r"^\w+=", words[0])):
            words = words[1:]
        if words and words[0] != ">":
            out.append(words)
    return out


def _subcommands(words: list[str]) -> list[list[str]]:
    """`ray job submit ... -- dspark serve ...` holds a second command after `--`."""
    if "--" in words:
        return [words[: words.index("--")], *_subcommands(words[words.index("--") + 1:])]
    return [words]


def _readme_shell_lines(path: Path) -> list[str]:
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", path.read_text(), flags=re.S)
    return [line for block in blocks for line in _shell_lines(block)]


def _manifest_shell_lines() -> list[tuple[str, str]]:
    """(where, shell line) of every command in cluster.yaml and in the Kubernetes containers."""
    lines = []
    cluster = _cluster()
    for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        lines += [(f"cluster.yaml {key}", line) for cmd in cluster.get(key) or [] for line in _shell_lines(cmd)]
    for name, node_type in cluster["available_node_types"].items():
        for key in ("initialization_commands", "worker_setup_commands"):
            lines += [(f"cluster.yaml {name} {key}", line) for cmd in node_type.get(key) or []
                      for line in _shell_lines(cmd)]
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in _docs(path):
            for container in [c for key in ("containers", "initContainers") for cs in _walk(doc, key) for c in cs]:
                command, args = container.get("command") or [], container.get("args") or []
                where = f"{path.name} {container['name']}"
                if command and Path(command[0]).name in ("sh", "bash") and any(
                        a.startswith("-") and "c" in a for a in command[1:]):
                    lines += [(where, line) for script in args for line in _shell_lines(script)]
                elif command or args:
                    lines.append((where, shlex.join(command + args)))
    return lines


def _dspark_command_lines() -> list[tuple[str, list[str]]]:
    found = []
    readme = [("infra/README.md", line) for line in _readme_shell_lines(INFRA / "README.md")]
    sources = [*_manifest_shell_lines(), *readme]
    for where, line in sources:
        for words in _commands(line):
            found += [(where, sub) for sub in _subcommands(words) if sub and sub[0] == "dspark"]
    return found


def _ray_start_lines() -> list[list[str]]:
    return [sub for _, line in _manifest_shell_lines() for words in _commands(line) for sub in _subcommands(words)
            if sub[:2] == ["ray", "start"]]


def _pool_demand(pool: PoolSettings) -> dict[str, float]:
    """What one replica reserves on one node: tensor_parallel bundles of a STRICT_PACK placement group."""
    shards = pool.tensor_parallel
    demand = {"CPU": pool.num_cpus * shards, "GPU": pool.num_gpus * shards}
    demand |= {name: amount * shards for name, amount in pool.resources.items()}
    return {k: v for k, v in demand.items() if v > 0}


def _per_node(capacity: dict[str, float], demand: dict[str, float]) -> int:
    return min(math.floor(capacity.get(k, 0.0) / v + 1e-9) for k, v in demand.items())


def _kuberay_capacity(params: dict) -> dict[str, float]:
    capacity = {"CPU": float(params.get("num-cpus", 0)), "GPU": float(params.get("num-gpus", 0))}
    raw = params.get("resources")
    if raw:
        decoded = json.loads(raw) if raw.startswith('"') else raw  # '"{\"drafter_node\": 1}"' → JSON text
        capacity |= {k: float(v) for k, v in json.loads(decoded).items()}
    return capacity


def _allows_from_anywhere(policy: dict) -> set[int] | None:
    """Ports a NetworkPolicy opens to every source (None: all ports)."""
    opened: set[int] = set()
    for rule in policy["spec"].get("ingress", []):
        if rule.get("from"):
            continue
        if not rule.get("ports"):
            return None
        opened |= {p["port"] for p in rule["ports"]}
    return opened


def _selects(policy: dict, labels: dict) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_parses(path: Path):
    docs = _docs(path)
    assert docs, f"{path} holds no YAML document"
    for doc in docs:  # and the YAML embedded in ConfigMaps and in serveConfigV2
        for name, text in (doc.get("data") or {}).items():
            if name.endswith((".yaml", ".yml")):
                assert isinstance(yaml.safe_load(text), dict), f"{path}: data.{name}"
        for text in _walk(doc, "serveConfigV2"):
            assert isinstance(yaml.safe_load(text), dict), f"{path}: serveConfigV2"


@pytest.mark.parametrize("name", ["serve.example.yaml", "cluster.serve.yaml"])
def test_serve_configs_validate(name: str, monkeypatch):
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    assert isinstance(load(ServeSettings, INFRA / name, {}), ServeSettings)


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayservice.yaml"])
def test_configmap_serve_config_is_cluster_serve_yaml(manifest: str, tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    maps = [d for d in _kind(KUBERAY / manifest, "ConfigMap") if "cluster.serve.yaml" in d.get("data", {})]
    assert len(maps) == 1, f"{manifest}: one ConfigMap with cluster.serve.yaml"
    embedded = tmp_path / "cluster.serve.yaml"
    embedded.write_text(maps[0]["data"]["cluster.serve.yaml"])
    load(ServeSettings, embedded, {})
    assert embedded.read_text() == (INFRA / "cluster.serve.yaml").read_text(), (
        f"{manifest}: the ConfigMap's copy differs from infra/cluster.serve.yaml")


@pytest.mark.parametrize(("manifest", "key", "source"), [
    ("redis.yaml", "redis.conf", "redis/redis.conf"), ("otel-collector.yaml", "collector.yaml", "otel/collector.yaml")])
def test_configmap_copies_are_equal(manifest: str, key: str, source: str):
    copies = [d["data"][key] for d in _kind(KUBERAY / manifest, "ConfigMap") if key in d.get("data", {})]
    assert copies == [(INFRA / source).read_text()], f"{manifest}: the ConfigMap's {key} differs from infra/{source}"


def test_cluster_serve_config_points_at_the_services(monkeypatch):
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    s = _serve()
    assert s.router.host == "0.0.0.0" and not s.router.api_key, "the key comes from DSPARK_API_KEY, not the file"
    board = urlparse(s.router.redis_url)
    assert (board.scheme, board.username, board.hostname, board.port) == ("redis", "dspark", "redis", 6379)
    redis_services = [d for d in _kind(KUBERAY / "redis.yaml", "Service")]
    assert [(d["metadata"]["name"], d["spec"]["ports"][0]["port"]) for d in redis_services] == [("redis", 6379)]
    collector_services = _kind(KUBERAY / "otel-collector.yaml", "Service")
    collector = f"http://{collector_services[0]['metadata']['name']}:{collector_services[0]['spec']['ports'][0]['port']}"
    for role in ("verifier", "drafter", "router"):
        section = getattr(s, role)
        assert (section.traces, section.otlp_traces_endpoint) == ("otlp", collector), role
    receiver = _docs(INFRA / "otel" / "collector.yaml")[0]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert receiver.rsplit(":", 1)[1] == "4317"
    assert s.ray.namespace == "dspark"


def test_router_port_is_the_only_public_port(monkeypatch):
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    port = _serve().router.port
    opened = {(p["FromPort"], p["ToPort"]) for p in _cluster()["provider"]["security_group"]["IpPermissions"]}
    assert opened == {(port, port)}, "cluster.yaml's security group opens only the router's port"
    for manifest in ("raycluster.yaml", "rayservice.yaml"):
        head_ports = {}
        spec = dict(_ray_cluster_specs())[manifest]
        for container in spec["headGroupSpec"]["template"]["spec"]["containers"]:
            head_ports |= {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        services = _kind(KUBERAY / manifest, "Service")
        assert services and all(head_ports[p["targetPort"]] == port for s in services for p in s["spec"]["ports"])
        labels = spec["headGroupSpec"]["template"]["metadata"]["labels"] | {"ray.io/node-type": "head"}
        policies = [p for p in _kind(KUBERAY / manifest, "NetworkPolicy") if _selects(p, labels)]
        assert policies, f"{manifest}: no NetworkPolicy guards the Ray pods"
        for policy in policies:
            assert _allows_from_anywhere(policy) in (set(), {port}), (
                f"{manifest}: NetworkPolicy {policy['metadata']['name']} opens more than the router's port")


def test_serve_config_paths_are_mounted():
    cluster = _cluster()
    commands = _dspark_command_lines()
    serve = [(where, words) for where, words in commands if words[1:2] == ["serve"]]
    assert any(where.startswith("cluster.yaml") for where, _ in serve), "cluster.yaml starts no dspark serve"
    assert any(where.startswith("raycluster.yaml") for where, _ in serve), "raycluster.yaml starts no dspark serve"
    for where, words in serve:
        if where.startswith("infra/README.md"):
            continue
        config = words[words.index("--config") + 1]
        if where.startswith("cluster.yaml"):
            assert (ROOT / cluster["file_mounts"][config]).resolve() == INFRA / "cluster.serve.yaml", where
        else:
            assert config == "/home/ray/dspark/cluster.serve.yaml", where
    for _, spec in _ray_cluster_specs():  # the ConfigMap at /home/ray/dspark in every pod
        for group, template in _pod_specs(spec):
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            mounts = {m["mountPath"]: volumes[m["name"]] for c in template["spec"]["containers"]
                      for m in c.get("volumeMounts", [])}
            assert mounts.get("/home/ray/dspark", {}).get("configMap", {}).get("name") == "dspark-serve-config", group


def test_dspark_command_lines_parse():
    """Every `dspark ...` of the manifests and of infra/README.md parses with the real `dspark` parser."""
    from cli.main import build_parser

    commands = _dspark_command_lines()
    verbs = {words[1] for _, words in commands}
    assert {"serve", "scale"} <= verbs, f"expected dspark serve and dspark scale among {sorted(verbs)}"
    failures = []
    for where, words in commands:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                build_parser().parse_args(words[1:])
        except SystemExit:
            failures.append(f"{where}: {shlex.join(words)}\n    {stderr.getvalue().strip().splitlines()[-1]}")
    assert not failures, "\n".join(failures)


def test_images_are_built_here_or_pinned():
    dockerfile = (INFRA / "Dockerfile").read_text()
    built = set(re.findall(r"docker build -f infra/Dockerfile -t (\S+)", dockerfile))
    assert built == {"dspark:0.1.0", "dspark:0.1.0-gpu"}, f"Dockerfile header builds {built}"
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, flags=re.M).group(1)
    assert base == "rayproject/ray:2.60.0-py311-cpu"
    assert re.search(r"pip install [^\n]*\"?torch==2\.13\.0", dockerfile)
    assert "pip wheel --no-cache-dir --no-deps -w /tmp/wheels ." in dockerfile
    assert re.search(r"^COPY .*models/ ", dockerfile, flags=re.M) and "DSPARK_MODELS_DIR" in dockerfile

    cluster = _cluster()
    images = [(f"cluster.yaml docker.{k}", v) for k, v in cluster["docker"].items() if k.endswith("image")]
    images += [(f"cluster.yaml {name}", t["docker"]["worker_image"])
               for name, t in cluster["available_node_types"].items() if "docker" in t]
    for path in sorted(KUBERAY.glob("*.yaml")):
        images += [(path.name, image) for doc in _docs(path) for image in _walk(doc, "image")]
    assert images
    for where, image in images:
        assert not image.endswith(":latest") and ":" in image.rsplit("/", 1)[-1], f"{where}: {image} is not pinned"
        dspark = DSPARK_IMAGE.match(image)
        if dspark:
            assert f"dspark:{dspark['tag']}" in built, f"{where}: {image} is not built by infra/Dockerfile"
        else:
            assert any(p.match(image) for p in UPSTREAM_IMAGES), f"{where}: unexpected image {image}"
    ray_version = re.search(r"rayproject/ray:(\d+\.\d+\.\d+)-", base).group(1)
    assert {spec["rayVersion"] for _, spec in _ray_cluster_specs()} == {ray_version}


def test_pool_resources_are_provided_by_the_cluster(monkeypatch):
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    pools = _serve().pools
    cluster = _cluster()
    head = cluster["head_node_type"]
    node_types = {name: (t["resources"], t.get("max_workers", 0)) for name, t in cluster["available_node_types"].items()
                  if name != head}
    assert cluster["max_workers"] >= sum(m for _, m in node_types.values())
    providers = {"cluster.yaml": node_types}
    for manifest, spec in _ray_cluster_specs():
        providers[manifest] = {g["groupName"]: (_kuberay_capacity(g["rayStartParams"]), g["maxReplicas"])
                               for g in spec["workerGroupSpecs"]}
        head_capacity = _kuberay_capacity(spec["headGroupSpec"]["rayStartParams"])
        assert head_capacity["GPU"] == 0, f"{manifest}: no model work on the head"
        assert not set(head_capacity) & {k for p in POOLS for k in getattr(pools, p).resources}, manifest
        for group in spec["workerGroupSpecs"]:  # Ray's GPUs are the pod's GPUs
            limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert float(limits.get("nvidia.com/gpu", 0)) == float(group["rayStartParams"].get("num-gpus", 0))
    assert not set(cluster["available_node_types"][head]["resources"]) & {"GPU", "verifier_node", "drafter_node"}
    for where, groups in providers.items():
        for role in POOLS:
            pool = getattr(pools, role)
            assert pool.resources, f"pools.{role} asks for no custom resource: it could land on the head"
            demand = _pool_demand(pool)
            hosts = {name: (capacity, most) for name, (capacity, most) in groups.items()
                     if all(capacity.get(k, 0) > 0 for k in pool.resources)}
            assert hosts, f"{where}: no node type offers {sorted(pool.resources)} (pools.{role})"
            for name, (capacity, _) in hosts.items():
                assert _per_node(capacity, demand) >= 1, f"{where}: one {role} replica {demand} does not fit {name}"
            room = sum(most * _per_node(capacity, demand) for capacity, most in hosts.values())
            assert room >= pool.max_replicas, f"{where}: room for {room} {role} replicas < max_replicas"


def test_dashboard_on_loopback_and_token_auth():
    heads = [words for words in _ray_start_lines() if "--head" in words]
    assert heads, "cluster.yaml starts no Ray head"
    for words in heads:
        assert "--dashboard-host=127.0.0.1" in words, shlex.join(words)
    run_options = " ".join(_cluster()["docker"]["run_options"])
    assert "RAY_AUTH_MODE=token" in run_options and "RAY_AUTH_TOKEN_PATH=" in run_options
    for manifest, spec in _ray_cluster_specs():
        assert spec.get("authOptions", {}).get("mode") == "token", f"{manifest}: Ray token authentication"
        host = spec["headGroupSpec"]["rayStartParams"].get("dashboard-host", "0.0.0.0")  # KubeRay's default
        if host == "127.0.0.1":
            continue
        # The RayService's operator reaches the dashboard: then only the operator may (port 8265).
        assert manifest == "rayservice.yaml", f"{manifest}: dashboard-host {host}"
        labels = spec["headGroupSpec"]["template"]["metadata"]["labels"] | {"ray.io/node-type": "head"}
        dashboard = [rule for p in _kind(KUBERAY / manifest, "NetworkPolicy") if _selects(p, labels)
                     for rule in p["spec"].get("ingress", []) if 8265 in {x["port"] for x in rule.get("ports", [])}]
        assert dashboard and all(all("namespaceSelector" in f for f in rule.get("from", [{}])) for rule in dashboard)


def test_rayservice_runs_the_serve_app():
    service = _kind(KUBERAY / "rayservice.yaml", "RayService")[0]["spec"]
    serve = yaml.safe_load(service["serveConfigV2"])
    (app,) = serve["applications"]
    env = app["runtime_env"]["env_vars"]
    assert env["DSPARK_SERVE_CONFIG"] == "/home/ray/dspark/cluster.serve.yaml"
    proxy_port = serve["http_options"]["port"]
    assert proxy_port != _serve().router.port, "Ray Serve's proxy and dspark's router on one port"
    for group, template in _pod_specs(service["rayClusterConfig"]):
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert ports.get("serve") == proxy_port, f"{group}: KubeRay probes Serve on the container port `serve`"
    module, _, attr = app["import_path"].partition(":")
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"import_path {app['import_path']}: {path.relative_to(ROOT)} does not exist"
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    assert attr in names, f"{path.relative_to(ROOT)} defines no top-level `{attr}`"


def _acl_user(conf: str, name: str) -> list[str]:
    lines = [line.split() for line in conf.splitlines() if line.split()[:2] == ["user", name]]
    assert len(lines) == 1, f"one `user {name}` line"
    return lines[0][2:]


def test_redis_conf_is_private_and_least_privilege():
    conf = (INFRA / "redis" / "redis.conf").read_text()
    directives = {line.split()[0]: line.split(None, 1)[1] for line in conf.splitlines()
                  if line.strip() and not line.startswith("#") and line.split()[0] != "user"}
    assert directives["protected-mode"] == "yes"
    assert "0.0.0.0" not in directives["bind"] and "*" not in directives["bind"].split()
    assert directives["save"] == '""' and directives["appendonly"] == "no"
    assert directives["maxmemory"] and directives["maxmemory-policy"] != "noeviction"
    assert _acl_user(conf, "default") == ["off"]
    rules = _acl_user(conf, "dspark")
    assert rules[0] == "on" and rules[1].startswith("#"), "the password as a SHA-256 hash"
    keys = [r for r in rules if r.startswith(("~", "%")) or r in ("allkeys", "resetkeys")]
    assert keys == ["resetkeys", f"~{PREFIX}*"], f"dspark user keys {keys}: only the board's prefix"
    assert "-@all" in rules and "resetchannels" in rules
    allowed = {r[1:] for r in rules if r.startswith("+")}
    assert allowed <= {"set", "get", "mget", "scan", "ping", "client|setinfo"}, allowed


def test_redis_acl_admits_the_board_and_nothing_else(tmp_path):
    """The ACL of redis.conf, on a private loopback redis-server: the load board works, the rest is refused."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    password = "test-password"
    digest = hashlib.sha256(password.encode()).hexdigest()
    conf = (INFRA / "redis" / "redis.conf").read_text().replace("#CHANGE_ME_SHA256", f"#{digest}")
    (tmp_path / "redis.conf").write_text(conf)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf"), "--port", str(port), "--bind",
                               "127.0.0.1", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        board = RedisBoard(f"redis://dspark:{password}@127.0.0.1:{port}/0", timeout_s=2.0)
        assert board.publish(EngineLoad("v0", "verifier", kv_used=2, kv_total=8, ts=time.time()), ttl_s=5.0)
        assert [entry.engine_id for entry in board.read("verifier")] == ["v0"]
        assert board.publish_profile("v0", [(1, 2.5), (8, 3.0)]) and board.profile("v0") == [(1, 2.5), (8, 3.0)]
        assert board.failures == 0
        def client(**kw) -> redis.Redis:  # no retries: a refused login fails at once
            return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0), **kw)

        board_user = client(username="dspark", password=password)
        for command in (("SET", "other", "1"), ("GET", "other"), ("KEYS", "*"), ("FLUSHALL",), ("DEL", f"{PREFIX}x"),
                        ("CONFIG", "GET", "maxmemory"), ("EVAL", "return 1", "0")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                board_user.execute_command(*command)
        with pytest.raises(redis.exceptions.AuthenticationError):
            client().ping()  # user default is off
        with pytest.raises(redis.exceptions.AuthenticationError):
            client(username="dspark", password="wrong").ping()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_redis_password_placeholder_is_filled_from_a_secret():
    conf = (INFRA / "redis" / "redis.conf").read_text()
    assert "#CHANGE_ME_SHA256" in conf  # Redis refuses to start until it is replaced
    (deployment,) = _kind(KUBERAY / "redis.yaml", "Deployment")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert "#CHANGE_ME_SHA256" in " ".join(init["args"]) and "sha256sum" in " ".join(init["args"])
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in init["env"]] == ["dspark-redis"]


def test_collector_pipelines_use_only_defined_components():
    config = _docs(INFRA / "otel" / "collector.yaml")[0]
    pipelines = config["service"]["pipelines"]
    assert "traces" in pipelines
    for name, pipeline in pipelines.items():
        for section in ("receivers", "processors", "exporters"):
            used = pipeline.get(section, [])
            assert section == "processors" or used, f"pipeline {name} has no {section}"
            missing = set(used) - set(config.get(section) or {})
            assert not missing, f"pipeline {name}: {section} {sorted(missing)} are not defined"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


def test_cluster_yaml_matches_rays_schema():
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed")
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(_cluster(), schema)
    assert _cluster()["head_node_type"] in _cluster()["available_node_types"]


def test_the_image_installs_every_package_the_cli_imports(tmp_path):
    """The image installs the wheel pyproject.toml's package list makes (infra/Dockerfile): that wheel holds every
    package of the layering, and `dspark`'s entry point imports from it alone (no checkout on the path)."""
    import tomllib
    import zipfile

    from tests.test_layering import ALLOWED

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in listed} == set(ALLOWED)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheels"), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("dspark-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        tops = {n.split("/")[0] for n in z.namelist() if "/" in n and ".dist-info" not in n.split("/")[0]}
    assert tops == set(ALLOWED)
    code = "import cli.main, services.kernels; cli.main.build_parser(); print(cli.main.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout
