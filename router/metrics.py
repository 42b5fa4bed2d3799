"""Prometheus metrics of the router (docs/design.md §10), vLLM-compatible where vLLM has a name for it.

Counters, not gauges, for speculation so rates aggregate across replicas:
acceptance rate = rate(accepted_tokens) / rate(draft_tokens); τ = 1 + rate(accepted_tokens) / rate(drafts).
Each router owns its registry (several can live in one test process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "dspark:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model: str = ""):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=(), prefix=PREFIX):
            return Counter(prefix + name, doc, [*labels, *extra], registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Cycles that verified at least one draft token")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens sent for verification (Σ ℓ)")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position (0-based)", ["position"])
        # The same four under vLLM's names, which vLLM's benchmark client reads for its speculation summary.
        self.vllm = [counter(name, doc + " (vLLM's name)", extra, "vllm:") for name, doc, extra in (
            ("spec_decode_num_drafts", "Cycles that verified at least one draft token", ()),
            ("spec_decode_num_draft_tokens", "Draft tokens sent for verification", ()),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", ()),
            ("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position", ("position",)))]
        self.spec_cache_hits = counter("spec_cache_hits", "Draft requests answered from the drafter's speculation "
                                       "cache (a block drafted ahead, during the verification before)")
        self.spec_cache_pushed = counter("spec_cache_pushed", "Cycles whose block the router already held when the "
                                         "verification before ended: pushed by the drafter, no draft request sent")
        self.spec_cache_misses = counter("spec_cache_misses", "Draft requests after an ahead notice that the "
                                         "speculation cache could not answer (drafted afresh)")
        self.ahead_accepted_per_pos = counter("spec_cache_accepted_tokens_per_pos", "Accepted draft tokens of "
                                              "blocks drafted ahead, by position (0-based)", ["position"])
        self.spec_cache_fanout = Histogram(PREFIX + "spec_cache_fanout", "Blocks the drafter had pre-drafted for "
                                           "a cycle's likely outcomes, per draft request after an ahead notice",
                                           labels, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.requests = counter("request_success", "Finished requests by finish reason", ["finished_reason"])
        self.rejected = counter("requests_rejected", "Requests refused before admission", ["reason"])
        self.ignored_fields = counter("ignored_request_fields", "Request fields no model here reads, by name "
                                      "(refused instead when the API runs with strict fields)", ["field"])
        self.drafter_detached = counter("drafter_detached", "Sessions that lost their drafter and fell back to "
                                        "plain decoding")
        self.verifier_reprefills = counter("verifier_reprefills", "Sessions re-prefilled after losing their verifier")
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "(E2E − TTFT) / (tokens − 1) per request",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.verify_len = Histogram(PREFIX + "verify_len", "ℓ chosen per cycle", labels,
                                    buckets=tuple(range(17)), registry=r)
        self.verify_budget = Histogram(PREFIX + "verify_budget", "Verify budget K (draft tokens per verifier step) "
                                       "of the plan in force, per dspark cycle", labels,
                                       buckets=(0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256), registry=r)
        self.trimmed_draft_tokens = counter("spec_decode_num_trimmed_draft_tokens", "Drafted tokens the scheduler "
                                            "did not send for verification")
        self.scheduler_time = Histogram(PREFIX + "scheduler_time_seconds", "Time to choose ℓ for one block", labels,
                                        buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3), registry=r)
        self.scheduler_cycles = counter("scheduler_cycles", "dspark cycles (drafted or skipped) by the verifier load "
                                        "their plan counted: "
                                        "board (a fresh load-board entry) or local (this router's own requests)",
                                        ["source"])
        self.plain_handoffs = counter("scheduler_plain_handoffs", "dspark requests handed to a plain run on their "
                                      "verifier for good, because their plan said drafting does not pay")
        self.drafts_skipped = counter("scheduler_drafts_skipped", "dspark cycles decoded without drafting because "
                                      "drafting did not pay at the verifier's load")
        self.pool_replicas = Gauge(PREFIX + "pool_replicas", "Serving replicas of each pool (draining ones left "
                                   "out), as this router sees them", [*labels, "pool"], registry=r)
        self.scale_events = counter("scale_events", "Replica-count changes of the deployment's pools",
                                    ["pool", "direction", "trigger"])
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in a session", labels, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a session", labels, registry=r)
        self.model = model
        self._children: dict[tuple, object] = {}

    def _of(self, metric, *values: str):
        """`metric.labels(model, *values)`, looked up once: a cycle records about ten samples, and prometheus'
        `labels` costs more than the sample (it was a tenth of an in-process cycle's loop time)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model, *values)
        return child

    def cycle(self, verify_len: int, accepted: int) -> None:
        self._of(self.verify_len).observe(verify_len)
        if verify_len == 0:
            return
        for drafts, tokens, accepted_tokens, per_pos in ((self.num_drafts, self.num_draft_tokens,
                                                          self.num_accepted_tokens, self.accepted_per_pos), self.vllm):
            self._of(drafts).inc()
            self._of(tokens).inc(verify_len)
            self._of(accepted_tokens).inc(accepted)
            for pos in range(accepted):
                self._of(per_pos, str(pos)).inc()

    def ahead(self, hit: bool, accepted: int, fanout: int = 0, pushed: bool = False) -> None:
        """A cycle after an ahead notice: its block drafted ahead (hit) or not; `accepted`: of a hit; `fanout`: the
        blocks the drafter had pre-drafted for the cycle's outcomes; `pushed`: a hit the router held already."""
        self._of(self.spec_cache_hits if hit else self.spec_cache_misses).inc()
        if pushed:
            self._of(self.spec_cache_pushed).inc()
        self._of(self.spec_cache_fanout).observe(fanout)
        for pos in range(accepted if hit else 0):
            self._of(self.ahead_accepted_per_pos, str(pos)).inc()

    def totals(self) -> tuple[float, float]:
        """(cycles with drafts, accepted draft tokens) so far: τ = 1 + accepted / cycles."""
        return self.num_drafts.labels(self.model)._value.get(), self.num_accepted_tokens.labels(self.model)._value.get()

    def scheduled(self, drafted: int, verify_len: int, seconds: float, budget: int | None,
                  source: str | None) -> None:
        self._of(self.trimmed_draft_tokens).inc(drafted - verify_len)
        self._of(self.scheduler_time).observe(seconds)
        if budget is not None:
            self._of(self.verify_budget).observe(budget)
            self._of(self.scheduler_cycles, source).inc()

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, ttft_s: float, e2e_s: float) -> None:
        m = self.model
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.e2e.labels(m).observe(e2e_s)
        if output_tokens > 1:
            self.tpot.labels(m).observe((e2e_s - ttft_s) / (output_tokens - 1))
