"""The serving benchmark's metric definitions (vLLM `bench serve` conventions), server-counter diffs and report.

Every expected number is computed by hand in the comments. Server scrapes come from the real
`router.metrics.RouterMetrics`, so the metric names are exactly those the server exports.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from benchmarks.serve_bench.cells import interpolate_speed, matched_ratios
from benchmarks.serve_bench.metrics import RequestResult, Slo, summarize
from benchmarks.serve_bench.plots import plots
from benchmarks.serve_bench.report import markdown
from benchmarks.serve_bench.server_metrics import scrape, spec_decode
from router.metrics import RouterMetrics

approx = pytest.approx


# --- summarize ---------------------------------------------------------------------------------------------------

def _requests() -> list[RequestResult]:
    """r1: 5 tokens in 4 chunks (one chunk carries 2), r2: 3 tokens, r3: 1 token, r4 failed."""
    return [RequestResult("dspark", 10, 5, "abcde", 0.1, 0.5, [0.1, 0.2, 0.1]),
            RequestResult("dspark", 20, 3, "abc", 0.2, 0.6, [0.4]),
            RequestResult("dspark", 30, 1, "a", 0.3, 0.3, []),
            RequestResult("dspark", 99, 7, "", 0.0, 0.0, [9.0], ok=False, error="HTTP 500")]


def test_summary_counts_and_throughputs_skip_failed_requests():
    s = summarize(_requests(), duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == approx(1.5)
    assert s["output_throughput"] == approx(4.5)
    assert s["total_token_throughput"] == approx(34.5)
    assert s["concurrency"] == approx((0.5 + 0.6 + 0.3) / 2.0)  # Σ E2EL / duration


def test_ttft_and_e2el_are_per_request_with_linear_percentiles():
    s = summarize(_requests(), duration_s=2.0)
    assert s["ttft_ms_mean"] == approx(200.0)
    assert s["ttft_ms_median"] == approx(200.0)
    assert s["ttft_ms_std"] == approx(math.sqrt((100**2 + 0 + 100**2) / 3))  # population std, as np.std
    assert s["ttft_ms_p50"] == approx(200.0)
    assert s["ttft_ms_p90"] == approx(280.0)  # rank 0.9·2 = 1.8 between 200 and 300
    assert s["ttft_ms_p99"] == approx(298.0)
    assert s["e2el_ms_mean"] == approx(1400 / 3)
    assert s["e2el_ms_median"] == approx(500.0)


def test_tpot_divides_by_tokens_and_skips_single_token_requests():
    s = summarize(_requests(), duration_s=2.0)
    # r1: (500 − 100) / 4 = 100 ms; r2: (600 − 200) / 2 = 200 ms; r3 has one token and no TPOT.
    assert s["tpot_ms_mean"] == approx(150.0)
    assert s["tpot_ms_median"] == approx(150.0)
    assert s["tpot_ms_p90"] == approx(190.0)
    assert s["tpot_ms_p99"] == approx(199.0)


def test_itl_is_pooled_over_requests_and_counts_chunks_not_tokens():
    s = summarize(_requests(), duration_s=2.0)
    # Pooled gaps 100, 200, 100, 400 ms: four gaps for eight decoded tokens, since chunks share tokens.
    assert s["itl_ms_mean"] == approx(200.0)
    assert s["itl_ms_median"] == approx(150.0)
    assert s["itl_ms_p99"] == approx(394.0)  # rank 0.99·3 = 2.97 between 200 and 400


def test_per_user_speed_is_inverse_tpot_with_slowest_tenth():
    s = summarize(_requests(), duration_s=2.0)
    # r1: 4 / 0.4 s = 10 tok/s, r2: 2 / 0.4 s = 5 tok/s; r3 undefined.
    assert s["per_user_tok_s_mean"] == approx(7.5)
    assert s["per_user_tok_s_median"] == approx(7.5)
    assert s["per_user_tok_s_p10"] == approx(5.5)


def test_goodput_requires_every_stated_slo():
    both = summarize(_requests(), 2.0, Slo(ttft_ms=250, tpot_ms=150))
    # r1 meets both; r2 misses TPOT (200 ms); r3 misses TTFT (300 ms).
    assert both["good_requests"] == 1
    assert both["request_goodput"] == approx(0.5)
    assert both["goodput_fraction"] == approx(1 / 3)
    assert both["goodput_slo"] == "ttft:250 tpot:150"
    # TPOT alone: r3's single token counts as TPOT 0 and passes (vLLM).
    assert summarize(_requests(), 2.0, Slo(tpot_ms=150))["good_requests"] == 2
    # Bounds are inclusive: r1's E2EL is exactly 500 ms.
    assert summarize(_requests(), 2.0, Slo(e2el_ms=500))["good_requests"] == 2


def test_goodput_is_none_without_slos():
    s = summarize(_requests(), 2.0)
    assert s["request_goodput"] is None and s["goodput_fraction"] is None and s["goodput_slo"] is None


@pytest.mark.parametrize("duration", [0.0, 5.0])
def test_empty_and_all_failed_cells_summarise_without_raising(duration):
    failed = [RequestResult("none", 5, 0, "", 0.0, 0.0, [], ok=False, error="timeout")]
    for results in ([], failed):
        s = summarize(results, duration, Slo(ttft_ms=100))
        assert s["completed"] == 0 and s["failed"] == len(results)
        assert s["ttft_ms_p99"] is None and s["tpot_ms_mean"] is None and s["per_user_tok_s_p10"] is None
        assert s["goodput_fraction"] is None
        assert s["output_throughput"] == (0.0 if duration else None)


# --- server metrics ----------------------------------------------------------------------------------------------

def _expose(m: RouterMetrics) -> str:
    return generate_latest(m.registry).decode()


def _window(model: str = "served-model") -> tuple[dict, dict]:
    """Two scrapes of a real RouterMetrics around a known window of cycles."""
    m = RouterMetrics(model=model)
    for _ in range(2):  # before the window: must not count
        m.cycle(4, 4)
        m.scheduled(4, 4, 1e-4, 32, "local")
    before = scrape(_expose(m))
    m.cycle(4, 3)
    m.cycle(4, 1)
    m.cycle(2, 0)
    m.cycle(0, 0)  # a cycle decoded without drafts: counted in verify_len, not in N
    m.scheduled(6, 4, 1e-4, 16, "local")
    m.scheduled(6, 4, 1e-4, 8, "board")
    m.scheduled(6, 2, 1e-4, None, None)
    m.drafts_skipped.labels(model).inc()
    m.finished("stop", 10, 20, 0.1, 1.0)
    return before, scrape(_expose(m))


def test_scrape_keeps_dspark_samples_with_stable_keys():
    _, after = _window()
    assert "dspark:spec_decode_num_drafts_total" in after
    assert "dspark:spec_decode_num_accepted_tokens_per_pos_total{position=0}" in after
    assert "dspark:verify_len_bucket{le=+Inf}" in after
    assert {"dspark:verify_budget_sum", "dspark:verify_budget_count"} <= after.keys()
    assert not any("model_name" in k or k.endswith("_created") for k in after)
    assert set(_window("another-model")[1]) == set(after)  # keys do not depend on the served model's name


def test_scrape_records_untouched_counters_and_histograms_as_zero():
    flat = scrape(_expose(RouterMetrics(model="x")))
    assert flat["dspark:spec_decode_num_drafts_total"] == 0.0
    assert flat["dspark:verify_len_sum"] == 0.0 and flat["dspark:verify_len_count"] == 0.0
    assert not any(k.startswith("dspark:num_requests_running") for k in flat)  # gauges: nothing to diff


def test_scrape_ignores_other_prefixes_and_sums_models():
    text = ('# TYPE other_total counter\nother_total 3\n'
            '# TYPE dspark:generation_tokens counter\n'
            'dspark:generation_tokens_total{model_name="a"} 2\ndspark:generation_tokens_total{model_name="b"} 5\n')
    assert scrape(text) == {"dspark:generation_tokens_total": 7.0}


def test_spec_decode_diffs_the_window():
    v = spec_decode(*_window())
    # Window: N = 3 cycles with drafts, D = 4 + 4 + 2 = 10, A = 3 + 1 + 0 = 4.
    assert (v["drafts"], v["draft_tokens"], v["accepted"]) == (3, 10, 4)
    assert v["tau"] == approx(1 + 4 / 3)
    assert v["acceptance_rate"] == approx(0.4)
    # Accepted per position 2, 1, 1, 0 (position 3 existed before the window but gained nothing).
    assert v["per_position_unconditional"] == approx([2 / 3, 1 / 3, 1 / 3, 0.0])
    assert v["per_position_conditional"] == approx([2 / 3, 1 / 2, 1.0, 0.0])
    assert v["mean_verify_len"] == approx((4 + 4 + 2 + 0) / 4)
    assert v["verify_cycles"] == 4
    assert v["verify_len_hist"] == {"0": 1, "2": 1, "4": 2}
    assert v["mean_verify_budget"] == approx((16 + 8) / 2)
    assert v["wasted_verify_fraction"] == approx(0.6)
    assert v["trimmed_draft_tokens"] == 2 + 2 + 4
    assert v["drafts_skipped"] == 1
    assert v["generation_tokens"] == 20


def test_spec_decode_without_speculation_or_series_gives_none():
    m = RouterMetrics(model="x")
    before = scrape(_expose(m))
    m.finished("length", 3, 8, 0.1, 0.5)  # the `none` arm: tokens, no drafts
    v = spec_decode(before, scrape(_expose(m)))
    assert v["generation_tokens"] == 8
    # Declared but never incremented reads 0; the ratios over it have no value.
    assert (v["drafts"], v["draft_tokens"], v["accepted"], v["drafts_skipped"]) == (0, 0, 0, 0)
    assert v["tau"] is None and v["acceptance_rate"] is None
    assert v["per_position_unconditional"] == [] and v["per_position_conditional"] == []
    assert v["mean_verify_len"] is None and v["wasted_verify_fraction"] is None
    empty = spec_decode({}, {})  # a server that exports none of these metrics
    assert all(x in (None, [], {}) for x in empty.values())


def test_spec_decode_counts_series_born_in_the_window_and_counter_resets():
    m = RouterMetrics(model="x")
    before = scrape(_expose(m))  # no labelled series yet
    m.cycle(3, 2)
    v = spec_decode(before, scrape(_expose(m)))
    assert (v["drafts"], v["accepted"], v["per_position_unconditional"]) == (1, 2, [1.0, 1.0])
    restarted = spec_decode({"dspark:spec_decode_num_drafts_total": 50.0}, {"dspark:spec_decode_num_drafts_total": 4.0})
    assert restarted["drafts"] == 4


def test_spec_decode_reads_the_speculation_cache_hit_rate():
    m = RouterMetrics(model="x")
    before = scrape(_expose(m))
    assert spec_decode(before, before)["spec_cache_hit_rate"] is None  # no draft request followed a notice
    for hit, pushed in ((True, True), (True, False), (False, False)):
        m.ahead(hit, 2, pushed=pushed)
    v = spec_decode(before, scrape(_expose(m)))
    assert (v["spec_cache_hits"], v["spec_cache_misses"]) == (2, 1) and v["spec_cache_hit_rate"] == approx(2 / 3)
    assert v["spec_cache_pushed"] == 1


# --- report ------------------------------------------------------------------------------------------------------

CURVES = {  # arm → [(c, output tok/s, per-user tok/s median)]
    "none": [(1, 50, 50), (4, 180, 45), (16, 600, 37.5)],
    "mtp1": [(1, 90, 90), (4, 320, 80), (16, 900, 56)],
    "dspark": [(1, 150, 150), (4, 500, 125), (16, 1200, 75)],
}


def _server(arm: str, c: int) -> dict:
    m = RouterMetrics(model="x")
    before = scrape(_expose(m))
    k = {"none": 0, "mtp1": 1}.get(arm, max(1, 8 // c))
    for accepted in range(k + 1):
        m.cycle(k, min(accepted, k))
        if arm == "dspark":
            m.scheduled(8, k, 1e-4, 8 * c, "local")
    m.finished("stop", 10, 20, 0.1, 1.0)
    return spec_decode(before, scrape(_expose(m)))


def _summary(tput: float, speed: float, duration: float = 10.0) -> dict:
    s = summarize([RequestResult("x", 10, 11, "t", 0.1, 0.1 + 10 / speed, [1 / speed] * 10)], duration,
                  Slo(ttft_ms=200))
    s.update(output_throughput=float(tput), per_user_tok_s_median=float(speed), per_user_tok_s_p10=0.8 * speed)
    return s


def _results() -> dict:
    cells = [{"arm": arm, "load": {"mode": "closed", "concurrency": c}, "summary": _summary(tput, speed),
              "server": _server(arm, c)} for arm, curve in CURVES.items() for c, tput, speed in curve]
    cells += [{"arm": arm, "load": {"mode": "open", "rate": rate}, "summary": _summary(20 * rate, 60 / rate),
               "server": _server(arm, 1)} for arm in ("none", "dspark") for rate in (1.0, 4.0)]
    return {"metadata": {"date": "2026-01-01", "machine": "1x H200", "model": "dspark-target", "dataset": "chat",
                         "max_tokens": 256, "temperature": 0.0, "git": "abc1234"},
            "cells": cells,
            "gates": {"greedy_identical": {"mtp1": True, "dspark-fixed": False, "dspark": True},
                      "distribution": {"dspark": {"p_value": 0.42, "passed": True}}}}


@pytest.fixture
def results() -> dict:
    return _results()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list:
    """Rendered once for the module: the plots are the slow part of this file."""
    return plots(_results(), tmp_path_factory.mktemp("plots"))


def test_interpolation_brackets_and_prefers_the_faster_segment():
    assert interpolate_speed([(100, 50)], 100) == 50
    assert interpolate_speed([(100, 50), (300, 40)], 50) is None
    assert interpolate_speed([(100, 50), (300, 40)], 200) == approx(45.0)
    # Past saturation throughput falls again: two segments bracket 250, the faster (42.5 vs 30) wins.
    assert interpolate_speed([(100, 50), (300, 40), (200, 20)], 250) == approx(42.5)


def test_matched_throughput_ratios(results):
    none = matched_ratios(results, "none")
    # c=1: dspark 150 tok/s; none between (50, 50) and (180, 45): 50 − 5·100/130.
    assert none[0]["other_speed"] == approx(50 - 5 * 100 / 130)
    assert none[0]["ratio"] == approx(150 / (50 - 5 * 100 / 130))
    assert none[2]["ratio"] is None  # 1200 tok/s is past none's curve
    mtp1 = matched_ratios(results, "mtp1")
    assert mtp1[1]["ratio"] == approx(125 / (80 - 24 * 180 / 580))


def test_plots_write_non_empty_pngs(images):
    assert [p.name for p in images] == ["pareto.png", "verify_budget.png", "acceptance.png", "open_loop.png"]
    for p in images:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_skip_what_has_nothing_to_draw(results, tmp_path):
    # Only the `none` arm, closed loop: no speculation to show and no open-loop cells, so only the Pareto plot.
    plain = {**results, "cells": [c for c in results["cells"] if c["arm"] == "none" and c["load"]["mode"] == "closed"]}
    assert [p.name for p in plots(plain, tmp_path / "plain")] == ["pareto.png"]
    assert plots({"cells": []}, tmp_path / "empty") == []


def test_markdown_has_tables_ratios_gates_and_images(results, images, tmp_path):
    text = markdown(results, images)
    assert "date: 2026-01-01 · machine: 1x H200 · model: dspark-target" in text
    assert "## Closed loop" in text and "## Open loop" in text
    assert "| arm | c | user tok/s p50 |" in text and "| arm | rate |" in text
    assert "| dspark | 16 | 75.0 | 60.0 | 1,200.0 |" in text
    assert f"{150 / (50 - 5 * 100 / 130):.2f}×" in text
    assert "### dspark / mtp1" in text and "outside range" in text
    assert "| greedy_identical | dspark-fixed | FAIL |" in text
    assert "| distribution | dspark | PASS | p_value=0.42 |" in text
    assert "1 gate result(s) FAIL" in text
    assert "![pareto](pareto.png)" in text
    assert "![pareto](plots/pareto.png)" in markdown(results, [tmp_path / "plots" / "pareto.png"], base=tmp_path)


def test_markdown_tolerates_missing_parts():
    text = markdown({"metadata": {}, "cells": [], "gates": {}})
    assert "No closed-loop `dspark` cells." in text and "No gates were run." in text
    one_arm = {"cells": [{"arm": "dspark", "load": {"mode": "closed", "concurrency": 1},
                          "summary": summarize([], 0.0), "server": spec_decode({}, {})}]}
    assert "Arm `none` was not run." in markdown(one_arm)


def test_throughput_is_per_gpu_when_every_cell_says_its_gpus(results):
    results["metadata"]["gpus"] = 2
    text = markdown(results)
    assert "tok/s/GPU" in text and "| dspark | 16 | 75.0 | 60.0 | 1,200.0 | 600.0 |" in text
