"""Settings of a verifier process (`python -m verifier_worker`, a verifier replica)."""

from __future__ import annotations

from pydantic import Field

from services.settings import GrpcServerSettings, Traces


class VerifierSettings(GrpcServerSettings):
    model: str = Field("dspark-target", description="target: shipped name or model directory")
    host: str = Field("127.0.0.1", description="bind address (loopback unless you mean otherwise)")
    port: int = Field(50051, ge=0, le=65535, description="0: any free port")
    dtype: str = "auto"
    device: str = "auto"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default, or one per pinned CPU)")
    cpus: list[int] | None = Field(None, description="pin the process to these CPU ids (like taskset; none: all)")
    num_slots: int = Field(16, ge=1, description="concurrent requests holding KV")
    max_len: int = Field(1024, ge=8, description="positions per KV slot")
    max_batch_tokens: int = Field(256, ge=1, description="prefill token budget per engine step")
    max_waiting: int = Field(256, ge=0, description="requests queued for a slot before RESOURCE_EXHAUSTED")
    compile: bool = Field(False, description="torch.compile the step forward (one graph, compiled at start-up)")
    tap_layers: list[int] | None = Field(None, description="feature taps; default: the drafters' (1, n/2, n−2)")
    lease_s: float = Field(60.0, gt=0, description="free requests prefilled but never attached to a stream")
    batch_window_ms: float = Field(5.0, ge=0, description="how long a step waits for the rest of its sessions")
    profile: bool = Field(True, description="measure the SPS(B) table at start-up (the dspark policy needs it)")
    profile_cache: bool = Field(True, description="reuse the SPS(B) table this host measured for the same model "
                                "files, dtype, device, threads and torch ($DSPARK_CACHE_DIR/sps; false: measure "
                                "at every start)")
    redis_url: str | None = Field(None, description="publish load (and the SPS profile) to this Redis")
    traces: Traces = "none"
    otlp_traces_endpoint: str | None = None
