"""Settings of the router process (`dspark router`, the router of `dspark serve`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from services.settings import Settings, Traces
from services.tls import TlsSettings


class RouterSettings(Settings):
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
    draft_ahead: bool = Field(False, description="send each cut block's verify length to the drafter, so that "
                              "replicas with a speculation cache (drafter ahead_budget > 0) draft ahead")
    max_gamma: int = Field(16, ge=1, le=64, description="largest γ a request may ask for (the tiers accept "
                           "blocks of at most 64)")
    threshold: float = Field(0.3, ge=0.0, le=1.0, description="λ of the threshold policy (and of dspark until the "
                             "verifier's SPS profile is known)")
    plain_depth: int = Field(8, ge=0, le=64, description="plain decoding (method none): steps a verifier decodes "
                             "before the router asks, each reply taking those done (0: one step per call)")
    stream_interval: int = Field(4, ge=1, le=64, description="plain decoding with plain_depth: tokens a verifier "
                                 "reply (and so an SSE event) waits for, fewer at the end (vLLM's --stream-interval)")
    plain_handoff: bool = Field(True, description="with plain_depth: a dspark request whose plan says drafting does "
                                "not pay is handed to a plain run on its verifier for the rest of its life")
    explore_cycles: int = Field(8, ge=0, description="threshold and dspark verify whole blocks until this many "
                                "cycles have verified drafts, so estimates that start low can learn (0: off)")
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
    strict_fields: bool = Field(False, description="refuse a request field the API does not know (400 naming it) "
                                "instead of logging and counting it (dspark:ignored_request_fields_total)")
    sse_keepalive_s: float = Field(0.0, ge=0, description="SSE keep-alive comment interval in seconds (0: none; "
                                   "some benchmark clients parse a comment as JSON)")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="largest HTTP request body read; larger ones get "
                                "413 unread")
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None

    @model_validator(mode="after")
    def _interval_within_depth(self) -> RouterSettings:
        if self.plain_depth and self.stream_interval > self.plain_depth:
            raise ValueError(f"stream_interval ({self.stream_interval}) exceeds plain_depth ({self.plain_depth})")
        return self

    @model_validator(mode="after")
    def _secrets_from_environment(self) -> RouterSettings:
        """DSPARK_API_KEY and DSPARK_REDIS_URL (it may hold a password) when the flag and the file say nothing."""
        if not self.api_key and os.environ.get("DSPARK_API_KEY"):
            self.api_key = [os.environ["DSPARK_API_KEY"]]
        if self.redis_url is None and os.environ.get("DSPARK_REDIS_URL"):
            self.redis_url = os.environ["DSPARK_REDIS_URL"]
        return self
