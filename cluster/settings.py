"""Deployment settings of `dspark serve`: every role's section, the Ray pools, Ray itself, the autoscaler."""

from __future__ import annotations

import logging

from pydantic import BaseModel, Field, model_validator

from cluster.speculative_config import SpeculativeFlags
from drafter_worker.settings import DrafterSettings
from router.settings import RouterSettings
from services.settings import Settings
from services.tls import TlsSettings, read_tls
from verifier_worker.settings import VerifierSettings


class PoolSettings(Settings):
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


class PoolsSettings(Settings):
    verifier: PoolSettings = PoolSettings()
    drafter: PoolSettings = PoolSettings()

    @model_validator(mode="after")
    def _drafters_unsharded(self) -> PoolsSettings:
        if self.drafter.tensor_parallel != 1:
            raise ValueError("drafter replicas are not sharded: pools.drafter.tensor_parallel must be 1")
        return self


class RaySettings(Settings):
    address: str | None = Field(None, description="join this Ray cluster (auto, host:port, ray://...); null: "
                                "start a local instance on 127.0.0.1")
    namespace: str = Field("dspark", description="Ray namespace of the named actors (controller, replicas)")
    node_ip_address: str | None = Field(None, description="with `address`: this node's address in the cluster, "
                                        "as its `ray start --node-ip-address` says, where the machine has several "
                                        "(null: Ray picks a Ray node of this machine, the head if it runs here)")
    log_to_driver: bool = Field(False, description="with `address`: print the cluster's actor logs here too. Off "
                                "by default: a driver that prints them busy-polls the GCS while the head is down (Ray "
                                "2.60: 1.5 cores of the router's process, every token 5 x slower); the logs stay "
                                "in Ray's log files (`ray logs`)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local instance (null: the machine's)")


class AutoscalerSettings(Settings):
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


class ServeSettings(SpeculativeFlags):
    """The deployment: each role's section, Ray, pools, autoscaler; and (top level, as vLLM's and SGLang's flags
    are) the speculative options those engines' users type (`cluster/speculative_config.py`)."""

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


def preflight(settings: ServeSettings) -> None:
    """What would otherwise fail in every replica, over and over: unreadable TLS files (this host's copies;
    a cluster's nodes need the same paths), a load board that refuses the URL's credentials."""
    from services.load_board import connect_board

    for role in (settings.verifier, settings.drafter, settings.router):
        read_tls(role.tls)
    if settings.router.redis_url:
        connect_board(settings.router.redis_url).client.close()


def check_models(settings: ServeSettings) -> None:
    """Every role's model resolves, configures and tokenizes here, before Ray or any replica starts: a model
    that cannot be served stops `dspark serve` at once (and a GGUF or pip model is converted once, here).
    A target with no drafters (none shipped for it, none named) is served without speculation, as vLLM
    serves a model for which no draft model is configured."""
    from services.model_config import ModelConfig
    from services.registry import drafters_of, model_name, resolve_model
    from services.tokenizer import TextTokenizer

    for name in dict.fromkeys((settings.router.model, settings.verifier.model, settings.drafter.model)):
        model_dir = resolve_model(name)
        ModelConfig.from_dir(model_dir)
        TextTokenizer.from_dir(model_dir)
    target = model_name(settings.drafter.model)
    if settings.router.method != "none" and not settings.drafter.drafters and not drafters_of(target):
        logging.getLogger(__name__).warning("no drafters are shipped for %s and none are named "
                                            "(drafter.drafters): serving it without speculation", target)
        settings.router.method = "none"
