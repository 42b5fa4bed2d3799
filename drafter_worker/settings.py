"""Settings of a drafter process (`python -m drafter_worker`, a drafter replica)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.settings import GrpcServerSettings, Traces


class DrafterSettings(GrpcServerSettings):
    model: str = Field("dspark-target", description="the target the drafters belong to")
    drafters: list[str] | None = Field(None, description="drafters to host; default: every shipped one of model")
    host: str = "127.0.0.1"
    port: int = Field(50052, ge=0, le=65535)
    dtype: str = "auto"
    device: str = "auto"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default, or one per pinned CPU)")
    cpus: list[int] | None = Field(None, description="pin the process to these CPU ids (like taskset; none: all)")
    drafter_format: Literal["auto", "dspark", "deepspec", "eagle3", "dflash"] = Field(
        "auto", description="checkpoint format of the drafters (auto: from each config.json)")
    eagle_aux_layer_convention: Literal["auto", "output", "input"] = Field(
        "auto", description="an EAGLE-3 head's layer ids: output of layer k (SpecForge/SGLang), input to layer k "
        "(vLLM), or auto (nested eagle_config ids: output; top-level ids and the default: input)")
    max_q: int = Field(64, ge=1, description="support size K of the sparse draft distribution q'")
    compile: bool = Field(False, description="torch.compile the greedy blocks of block drafters")
    ahead_budget: int = Field(2, ge=0, le=256, description="draft ahead for requests that ask (speculative.ahead): "
                              "blocks pre-drafted per request while its block is verified, for its likeliest "
                              "outcomes (0: no cache; SSD's runs on GPUs use 20–30; 2 broke even on 2 vCPUs)")
    ahead_fallback_queue: int = Field(0, ge=0, description="on a speculation-cache miss while at least this many "
                                      "draft requests wait, answer no drafts (the request decodes plainly this "
                                      "cycle) instead of queueing it: SSD's fallback at large batch (0: off)")
    steer_top: int = Field(0, ge=0, le=64, description="Saguaro sampling of requests that draft ahead: scale the "
                           "top this many tokens of each sampled draft's q by steer_factor, so a rejection's "
                           "recovered token falls on a pre-drafted outcome more often (0: off; exact either way)")
    steer_factor: float = Field(0.5, gt=0, le=1, description="the scale of steer_top (SSD's C)")
    lease_s: float = Field(60.0, gt=0, description="free a draft context no stream has carried for this long")
    batch_window_ms: float = Field(5.0, ge=0, description="how long a propose waits for the rest of its sessions")
    redis_url: str | None = Field(None, description="publish load to this Redis")
    seed: int = 0
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None
