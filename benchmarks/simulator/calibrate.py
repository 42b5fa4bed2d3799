"""Constants of the cost model from one `dspark bench` run (results.json) and the verifier's SPS profile.

Only the c = 1 cells are used here, where nothing overlaps and a cycle is a sum of its parts:
  hop_s      one-way router ↔ tier delay: not separable from the bench, so fixed at 0.3 ms (docs/serving.md:
             about 0.6 ms per gRPC round trip on this machine);
  router_s   plain cycle time − step(1) − 2 hops, with the plain cycle = the `none` arm's TPOT at c = 1; where
             `none` ran ahead on its verifier (plain runs: several tokens a reply) its TPOT is one step, so it
             sets the profile's speed instead (served steps vs the profiled ones at 256 cached positions) and
             router_s is the measured router work of a cycle, ROUTER_S (docs/results/engine.md, tier overhead);
  draft      per method: cycle time − step(1 + ℓ̄) − plain extra − 2 hops is one drafter step at batch 1, where
             cycle time = TPOT · decode tokens / verify cycles (≈ TPOT · τ) and ℓ̄ the measured mean verify length;
  ttft_offset  the `none` arm's TTFT at c = 1 − (step(P) + 2 hops): the profile's B = P point batches many short
             requests, a single prompt's prefill costs differently (and HTTP, tokenising); may be negative.
  ahead_hit  the `dspark-ahead` arm's share of draft requests answered from the speculation cache (server
             counters, pooled over its cells). The bench cannot tell a miss because the pre-drafting had not
             finished from one the cache did not cover, so as P(hit | pre-drafting finished) it is a lower bound.
The drafter's per-request slope and the shared-CPU contention factor are not visible at c = 1; `studies.fit_globals`
fits them (two numbers for all cells) against the c > 1 cells.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.simulator.model import Arm, CostModel, DraftCost, StepProfile

HOP_S = 0.0003  # one way; 0.6 ms per round trip (docs/serving.md, benchmarks/grpc_shapes.py)
ROUTER_S = 0.0006  # the router's own work per cycle, instrumented (docs/results/engine.md: 0.54–0.63 ms)
ARM_POLICY = {"none": ("none", "none"), "mtp1": ("mtp1", "mtp"), "eagle3": ("fixed", "eagle3"),
              "dflash": ("fixed", "dflash"), "dspark-fixed": ("fixed", "dspark"), "dspark": ("dspark", "dspark"),
              "dspark-ahead": ("dspark", "dspark")}


@dataclass(slots=True)
class SimCalibration:
    """What `calibrate` derived, with the per-method working shown (for the report)."""

    hop_s: float
    router_s: float
    ttft_offset_s: float
    draft_s: dict[str, float]  # method → one drafter step at batch 1
    arms: dict[str, Arm]
    prompt_tokens: int
    output_tokens: int
    working: dict[str, dict] = field(default_factory=dict)  # method → cycle_ms, step_ms, verify_len, draft_ms
    plain_run: int = 0  # tokens a reply of `none`'s plain runs carried (0: one exchange a token)
    step_speed: float = 1.0  # the profile's steps over the served ones (set from plain runs)

    def cost(self, profile: StepProfile, slope: float = 0.0, contention: float = 1.0) -> CostModel:
        """The cost model; `slope` is the drafter's per-request cost as a fraction of its batch-1 step."""
        draft = {m: _split(s, slope) for m, s in self.draft_s.items()}
        draft["default"] = _split(_mean(self.draft_s.values()), slope)
        served = StepProfile(profile.curve, profile.speed * self.step_speed)
        return CostModel(served, draft, self.hop_s, self.router_s, contention, self.ttft_offset_s,
                         plain_run=self.plain_run)


def load_results(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def closed_cells(results: dict) -> list[dict]:
    return [c for c in results.get("cells", []) if c.get("load", {}).get("mode", "closed") == "closed"
            and (c.get("summary") or {}).get("output_throughput")]


def cell_at(results: dict, arm: str, concurrency: int) -> dict | None:
    return next((c for c in closed_cells(results)
                 if c["arm"] == arm and c["load"].get("concurrency") == concurrency), None)


def cycle_s(cell: dict) -> float:
    """Mean decode-cycle time of a cell: decode time over all requests / verify cycles."""
    s, v = cell["summary"], cell["server"]
    decode_tokens = s["total_output_tokens"] - s["completed"]
    cycles = v.get("verify_cycles") or decode_tokens
    return s["tpot_ms_mean"] / 1000.0 * decode_tokens / cycles


def acceptance(cells: list[dict]) -> tuple[float, ...]:
    """Pooled per-position conditional acceptance c_k = u_k / u_{k−1} over cells, u_k the unconditional rate
    weighted by each cell's drafts (greedy cells repeat the same prompts, so pooling only averages noise)."""
    weights, sums = 0.0, []
    for cell in cells:
        v = cell.get("server") or {}
        drafts, u = v.get("drafts") or 0.0, [x for x in v.get("per_position_unconditional") or [] if x is not None]
        if not drafts or not u:
            continue
        weights += drafts
        sums.extend([0.0] * (len(u) - len(sums)))
        for k, x in enumerate(u):
            sums[k] += drafts * x
    u = [x / weights for x in sums] if weights else []
    out, prev = [], 1.0
    for x in u:
        if prev <= 0 or x <= 0:
            break
        out.append(min(x / prev, 1.0))
        prev = x
    return tuple(out)


def hit_rate(cells: list[dict]) -> float:
    """Pooled speculation-cache hit rate of cells (0 where the server counted no lookups)."""
    hits = sum((c.get("server") or {}).get("spec_cache_hits") or 0.0 for c in cells)
    misses = sum((c.get("server") or {}).get("spec_cache_misses") or 0.0 for c in cells)
    return hits / (hits + misses) if hits + misses else 0.0


def arms_of(results: dict) -> dict[str, Arm]:
    """One `Arm` per measured arm; scheduled dspark (with or without the cache) takes dspark-fixed's acceptance
    (same drafter, untrimmed)."""
    gamma = int(results.get("metadata", {}).get("gamma", 7))
    cells = closed_cells(results)
    names = sorted({c["arm"] for c in cells}, key=lambda a: list(ARM_POLICY).index(a) if a in ARM_POLICY else 99)
    arms = {}
    for name in names:
        policy, method = ARM_POLICY.get(name, ("fixed", name))
        fixed = any(c["arm"] == "dspark-fixed" for c in cells)
        source = "dspark-fixed" if name in ("dspark", "dspark-ahead") and fixed else name
        accept = acceptance([c for c in cells if c["arm"] == source])
        hit = hit_rate([c for c in cells if c["arm"] == name]) if name == "dspark-ahead" else 0.0
        arms[name] = Arm(name, policy, method, 1 if policy == "mtp1" else (0 if policy == "none" else gamma), accept,
                         ahead_hit=hit)
    return arms


def calibrate(results: dict, profile: StepProfile, hop_s: float = HOP_S) -> SimCalibration:
    """Constants from the c = 1 cells (module docstring). Raises ValueError without a `none` cell at c = 1."""
    plain = cell_at(results, "none", 1)
    if plain is None:
        raise ValueError("calibration needs the `none` arm at concurrency 1")
    s = plain["summary"]
    prompt = round(s["total_input_tokens"] / s["completed"])
    output = round(s["total_output_tokens"] / s["completed"])
    decode = s["total_output_tokens"] - s["completed"]
    per_reply = decode / (plain["server"].get("verify_cycles") or decode)
    plain_run, speed = 0, 1.0
    if per_reply > 1.5:  # plain runs: TPOT is one served step, hidden hops and router work
        plain_run, speed = round(per_reply), profile.step_s(1) / (s["tpot_ms_mean"] / 1000.0)
        profile = StepProfile(profile.curve, profile.speed * speed)
        plain_extra = ROUTER_S + 2 * hop_s
    else:
        plain_extra = max(cycle_s(plain) - profile.step_s(1), 2 * hop_s)
    router_s = plain_extra - 2 * hop_s
    ttft_offset = s["ttft_ms_mean"] / 1000.0 - profile.step_s(prompt) - 2 * hop_s
    draft_s, working = {}, {}
    for name, (policy, method) in ARM_POLICY.items():
        cell = cell_at(results, name, 1)
        if policy not in ("mtp1", "fixed") or cell is None or method in draft_s:
            continue
        ell = cell["server"].get("mean_verify_len") or 0.0
        cycle, step = cycle_s(cell), profile.step_s(1 + ell)
        draft = cycle - step - plain_extra - 2 * hop_s
        draft_s[method] = max(draft, 1e-4)
        working[method] = {"arm": name, "cycle_ms": cycle * 1e3, "step_ms": step * 1e3, "verify_len": ell,
                           "plain_extra_ms": plain_extra * 1e3, "draft_ms": draft_s[method] * 1e3}
    if not draft_s:
        draft_s["default"] = plain_extra
    return SimCalibration(hop_s, router_s, ttft_offset, draft_s, arms_of(results), prompt, output, working, plain_run,
                       speed)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _split(single_s: float, slope: float) -> DraftCost:
    """A batch-1 step of `single_s` as base + per-request cost, the per-request part `slope` of it."""
    return DraftCost(single_s * (1 - slope), single_s * slope)
