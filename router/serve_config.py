"""Settings of the serving roles: pydantic models that reject unknown keys, read from YAML and flags.

Precedence: command-line flag > `--config FILE` > defaults. Flag names are the field names in kebab
case (`num_slots` → `--num-slots`; a nested section's fields get its name first: `tls.cert` → `--tls-cert`);
in `dspark serve` the file has one section per role, and a top-level `tls:` that every role inherits.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.errors import InvalidRequestError
from services.tls import TlsSettings

Traces = Literal["none", "console", "otlp"]


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _GrpcServerSettings(_Settings):
    tls: TlsSettings | None = Field(None, description="serve gRPC over TLS (null: plaintext; keep it on loopback "
                                    "or a private network)")

    @model_validator(mode="after")
    def _tls_identity(self) -> _GrpcServerSettings:
        if self.tls is not None and self.tls.cert is None:
            raise ValueError("tls: a gRPC server needs cert and key")
        return self


class VerifierSettings(_GrpcServerSettings):
    model: str = Field("dspark-target", description="target: shipped name or model directory")
    host: str = Field("127.0.0.1", description="bind address (loopback unless you mean otherwise)")
    port: int = Field(50051, ge=0, le=65535, description="0: any free port")
    dtype: str = "auto"
    device: str = "auto"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default)")
    num_slots: int = Field(16, ge=1, description="concurrent requests holding KV")
    max_len: int = Field(1024, ge=8, description="positions per KV slot")
    max_batch_tokens: int = Field(256, ge=1, description="prefill token budget per engine step")
    max_waiting: int = Field(256, ge=0, description="requests queued for a slot before RESOURCE_EXHAUSTED")
    tap_layers: list[int] | None = Field(None, description="feature taps; default: the drafters' (1, n/2, n−2)")
    lease_s: float = Field(60.0, gt=0, description="free requests prefilled but never attached to a stream")
    batch_window_ms: float = Field(5.0, ge=0, description="how long a step waits for the rest of its sessions")
    profile: bool = Field(True, description="measure the SPS(B) table at start-up (the dspark policy needs it)")
    redis_url: str | None = Field(None, description="publish load (and the SPS profile) to this Redis")
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None


class DrafterSettings(_GrpcServerSettings):
    model: str = Field("dspark-target", description="the target the drafters belong to")
    drafters: list[str] | None = Field(None, description="drafters to host; default: every shipped one of model")
    host: str = "127.0.0.1"
    port: int = Field(50052, ge=0, le=65535)
    dtype: str = "auto"
    device: str = "auto"
    threads: int = Field(0, ge=0)
    max_q: int = Field(64, ge=1, description="support size K of the sparse draft distribution q'")
    lease_s: float = Field(60.0, gt=0, description="free a draft context no stream has carried for this long")
    batch_window_ms: float = Field(5.0, ge=0, description="how long a propose waits for the rest of its sessions")
    redis_url: str | None = Field(None, description="publish load to this Redis")
    seed: int = 0
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None


class RouterSettings(_Settings):
    model: str = Field("dspark-target", description="target (for the tokenizer and the served model name)")
    served_model_name: str | None = None
    host: str = Field("127.0.0.1", description="HTTP bind address; 0.0.0.0 to serve other machines")
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535, description="also serve dspark.v1.Router on this "
                                  "loopback port (null: HTTP only)")
    verifier: str = Field("127.0.0.1:50051", description="verifier replica address(es) host:port, comma-separated")
    drafter: str | None = Field("127.0.0.1:50052", description="drafter replica address(es), comma-separated; "
                                "null: no speculation")
    methods: list[str] = Field(["dspark", "dflash", "eagle3", "mtp"], description="methods the drafter hosts")
    method: str = Field("dspark", description="default speculative method (none to switch speculation off)")
    policy: Literal["none", "fixed", "mtp1", "threshold", "dspark"] = Field(
        "dspark", description="verify-length policy: dspark trims each block to the verifier's load")
    gamma: int = Field(7, ge=1, le=16)
    max_gamma: int = Field(16, ge=1, le=64, description="largest γ a request may ask for (the tiers accept "
                           "blocks of at most 64)")
    threshold: float = Field(0.3, ge=0.0, le=1.0, description="λ of the threshold policy (and of dspark until the "
                             "verifier's SPS profile is known)")
    redis_url: str | None = Field(None, description="read verifier load from this load board (null: count only "
                                  "this router's requests)")
    board_stale_ms: float = Field(500.0, gt=0, description="a board entry whose seq has not moved for this long "
                                  "is stale")
    max_running: int = Field(64, ge=1, description="requests in a session at once")
    max_queue: int = Field(256, ge=0, description="requests waiting for a session; beyond it 429 + Retry-After")
    verifier_timeout_s: float = Field(60.0, gt=0, description="deadline of each verifier call (a prefill or one "
                                      "cycle's reply); past it the replica is lost and the request re-prefills")
    drafter_timeout_s: float = Field(10.0, gt=0, description="deadline of each drafter call; past it the request "
                                     "decodes plainly and reopens its context elsewhere")
    verifier_retry_s: float = Field(30.0, gt=0, description="how long a request keeps re-prefilling while no "
                                    "verifier replica answers before it fails with 503")
    replica_down_s: float = Field(2.0, gt=0, description="a replica whose call failed gets no new request for "
                                  "this long")
    api_key: list[str] | None = Field(None, description="accepted API keys (or DSPARK_API_KEY)")
    tls: TlsSettings | None = Field(None, description="TLS to the verifier and drafter replicas (null: plaintext)")
    max_model_len: int = Field(1024, ge=8)
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="largest HTTP request body read; larger ones get "
                                "413 unread")
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None

    @model_validator(mode="after")
    def _secrets_from_environment(self) -> RouterSettings:
        """DSPARK_API_KEY and DSPARK_REDIS_URL (it may hold a password) when the flag and the file say nothing."""
        if not self.api_key and os.environ.get("DSPARK_API_KEY"):
            self.api_key = [os.environ["DSPARK_API_KEY"]]
        if self.redis_url is None and os.environ.get("DSPARK_REDIS_URL"):
            self.redis_url = os.environ["DSPARK_REDIS_URL"]
        return self


class PoolSettings(_Settings):
    """One pool of Ray actors: how many, what each reserves, how they restart."""

    replicas: int = Field(1, ge=0, description="replicas at start (the autoscaler moves it within min..max)")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    num_cpus: float = Field(1.0, ge=0, description="logical CPUs per actor (per shard for a TP verifier)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor; fractions let small drafters share one")
    resources: dict[str, float] = Field({}, description="custom resources per actor, e.g. {verifier_node: 1}")
    tensor_parallel: int = Field(1, ge=1, description="shards per replica (verifier only): STRICT_PACK "
                                 "placement group, torch.distributed gloo/nccl")
    max_restarts: int = Field(-1, ge=-1, description="Ray restarts of a crashed actor (-1: always)")

    @model_validator(mode="after")
    def _bounds(self) -> PoolSettings:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas {self.replicas} outside [min_replicas {self.min_replicas}, "
                             f"max_replicas {self.max_replicas}]")
        return self


class PoolsSettings(_Settings):
    verifier: PoolSettings = PoolSettings()
    drafter: PoolSettings = PoolSettings()

    @model_validator(mode="after")
    def _drafters_unsharded(self) -> PoolsSettings:
        if self.drafter.tensor_parallel != 1:
            raise ValueError("drafter replicas are not sharded: pools.drafter.tensor_parallel must be 1")
        return self


class RaySettings(_Settings):
    address: str | None = Field(None, description="join this Ray cluster (auto, host:port, ray://...); null: "
                                "start a local instance on 127.0.0.1")
    namespace: str = Field("dspark", description="Ray namespace of the named actors (controller, replicas)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local instance (null: the machine's)")


class AutoscalerSettings(_Settings):
    """Scales each pool from the load board: verifier saturation, drafter queueing."""

    enabled: bool = False
    interval_s: float = Field(2.0, gt=0, description="how often the board is read")
    verifier_high: float = Field(0.85, gt=0, description="scale verifiers up above this mean saturation")
    verifier_low: float = Field(0.3, ge=0, description="... and down below it")
    drafter_high: float = Field(2.0, gt=0, description="scale drafters up above this many queued drafts per replica")
    drafter_low: float = Field(0.25, ge=0, description="... and down below it")
    upscale_delay_s: float = Field(10.0, ge=0, description="a signal must hold this long before scaling up")
    downscale_delay_s: float = Field(60.0, ge=0, description="... and this long before scaling down")
    cooldown_s: float = Field(30.0, ge=0, description="no second change of a pool within this time")
    drain_timeout_s: float = Field(30.0, ge=0, description="a replica being removed takes no new requests and "
                                   "is killed once idle or after this long")


class ServeSettings(_Settings):
    tls: TlsSettings | None = Field(None, description="TLS of every gRPC hop: the replicas serve with it, the "
                                    "router connects with it (a role section's own tls: wins)")
    verifier: VerifierSettings = VerifierSettings()
    drafter: DrafterSettings = DrafterSettings()
    router: RouterSettings = RouterSettings()
    ray: RaySettings = RaySettings()
    pools: PoolsSettings = PoolsSettings()
    autoscaler: AutoscalerSettings = AutoscalerSettings()

    @model_validator(mode="before")
    @classmethod
    def _tls_to_every_role(cls, data):
        """Before the roles validate, so a server role without cert/key is refused as if it said tls: itself."""
        if not isinstance(data, dict) or data.get("tls") is None:
            return data
        data = dict(data)
        for role in ("verifier", "drafter", "router"):
            section = data.get(role, {})
            if isinstance(section, BaseModel):
                section = section.model_dump(exclude_unset=True)
            if section.get("tls") is None:
                data[role] = {**section, "tls": data["tls"]}
        return data


def _section(kind) -> type[BaseModel] | None:
    """The model of a nested section field (`TlsSettings | None` → TlsSettings), else None."""
    for k in (kind, *getattr(kind, "__args__", ())):
        if isinstance(k, type) and issubclass(k, BaseModel):
            return k
    return None


def add_flags(parser: argparse.ArgumentParser, settings: type[BaseModel], prefix: str = "") -> None:
    """One `--kebab-case` flag per field (a nested section's: `--section-field`, dest `section.field`); unset
    flags stay out of the merge (file and defaults win)."""
    for name, field in settings.model_fields.items():
        kind, dest = field.annotation, prefix + name
        if (section := _section(kind)) is not None:
            add_flags(parser, section, dest + ".")
            continue
        flag = "--" + dest.replace(".", "-").replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=field.description)
            continue
        kw = {"dest": dest, "metavar": dest.replace(".", "_").upper(), "default": argparse.SUPPRESS}
        if "list" in str(kind):
            parser.add_argument(flag, help=(field.description or "") + " (comma-separated)",
                                type=lambda s: [x for x in s.split(",") if x], **kw)
        else:
            parser.add_argument(flag, help=field.description, type=kind if kind in (int, float) else None, **kw)


def nest(flags: dict) -> dict:
    """Dotted flag destinations as sections: {"tls.cert": x} → {"tls": {"cert": x}}."""
    out: dict = {}
    for key, value in flags.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a flag sets one key of a file's section, not all of it)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load(settings: type[_Settings], config: Path | None, flags: dict) -> _Settings:
    raw = {}
    if config is not None:
        try:
            raw = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise InvalidRequestError(f"--config {config}: {error}") from None
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"--config {config}: expected a mapping")
    merged = merge(raw, nest(flags))
    try:
        return settings.model_validate(merged)
    except ValidationError as error:
        raise InvalidRequestError(f"bad settings: {error}") from None
