"""SLO metrics on hand-made request timelines."""

import pytest

from apt_serve_ray.bench.slo_metrics import (
    RequestTimeline,
    attainment,
    effective_throughput,
    format_summary,
    goodput,
    inter_token_gaps_ms,
    p99_gap_ms,
    passes_slo,
    summarize,
    tpot_ms,
    ttft_ms,
)


def timeline(token_times, arrival=0.0, is_finished=True, num_output_tokens=None, ttft_slo_ms=500.0,
             tbt_slo_ms=200.0, **kwargs):
    finish = token_times[-1] if is_finished and token_times else None
    return RequestTimeline(
        request_id="r", arrival_s=arrival, first_token_s=token_times[0] if token_times else None,
        token_times_s=list(token_times), finish_s=finish, num_prompt_tokens=10,
        num_output_tokens=len(token_times) if num_output_tokens is None else num_output_tokens,
        ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, **kwargs)


GOOD = timeline([1.2, 1.3, 1.4, 1.5], arrival=1.0)  # TTFT 200 ms, gaps 100 ms
SLOW_FIRST_TOKEN = timeline([0.6, 0.7, 0.8])  # TTFT 600 ms
TAIL_STALL = timeline([0.2, 0.25, 0.30, 0.9])  # gaps 50, 50, 600 ms


def test_ttft_and_gaps_exclude_the_first_token():
    assert ttft_ms(GOOD) == pytest.approx(200.0)
    assert inter_token_gaps_ms(GOOD) == pytest.approx([100.0, 100.0, 100.0])
    slow_start = timeline([2.0, 2.05, 2.10])
    assert p99_gap_ms(slow_start) == pytest.approx(50.0)  # the 2 s TTFT is not a gap


def test_p99_gap_interpolates_linearly_like_numpy():
    # Sorted gaps [50, 50, 600]: the 99th percentile sits at index 1.98 -> 50 + 0.98 * 550.
    assert p99_gap_ms(TAIL_STALL) == pytest.approx(589.0)
    assert p99_gap_ms(timeline([0.1])) == 0.0
    assert p99_gap_ms(timeline([])) == 0.0


def test_a_request_passes_only_with_both_ttft_and_tail_gap_under_slo():
    assert passes_slo(GOOD)
    assert not passes_slo(SLOW_FIRST_TOKEN)
    assert not passes_slo(TAIL_STALL)
    assert passes_slo(timeline([0.6, 0.7], ttft_slo_ms=None))  # an unset SLO is not checked
    assert passes_slo(timeline([0.1, 0.25], tbt_slo_ms=150.001))
    assert not passes_slo(timeline([0.1, 0.25], tbt_slo_ms=150.0))  # strictly below


def test_unfinished_and_failed_requests_fail():
    assert not passes_slo(timeline([0.1, 0.2], is_finished=False))
    assert not passes_slo(timeline([0.1, 0.2], error="HTTP 500"))
    assert not passes_slo(timeline([]))


def test_attainment_and_goodput():
    timelines = [GOOD, SLOW_FIRST_TOKEN, TAIL_STALL, timeline([0.1, 0.2])]
    assert attainment(timelines) == pytest.approx(0.5)
    assert goodput(timelines, duration_s=4.0) == pytest.approx(0.5)
    assert attainment([]) == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        goodput(timelines, 0.0)


def test_tpot_is_vllms_per_request_definition():
    # e2el 900 ms, ttft 200 ms, 4 tokens: (900 - 200) / 3.
    assert tpot_ms(TAIL_STALL) == pytest.approx(700 / 3)
    # Token counts come from the usage (here 7 tokens in 4 chunks), not from the chunk count.
    assert tpot_ms(timeline([0.2, 0.25, 0.30, 0.9], num_output_tokens=7)) == pytest.approx(700 / 6)
    assert tpot_ms(timeline([0.2])) is None


def test_summarize_reports_vllms_figures_over_completed_requests():
    failed = timeline([0.1], error="timeout")
    s = summarize([GOOD, TAIL_STALL, failed], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx((100.0 + 700 / 3) / 2)
    # ITL pools all gaps of all requests: [100, 100, 100, 50, 50, 600].
    assert s["mean_itl_ms"] == pytest.approx(1000 / 6)
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx(700.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["request_goodput"] == pytest.approx(0.5)
    text = format_summary(s)
    assert "Serving Benchmark Result" in text and "Median TPOT (ms):" in text
    assert "Successful requests:                     2" in text
    assert "ITL" not in format_summary(s, metrics=["ttft"])


POINTS = [(3.0, 0.80), (1.0, 0.99), (4.0, 0.50), (2.0, 0.95)]


@pytest.mark.parametrize("points, target, expected", [
    (POINTS, 0.9, 2.0 + 0.05 / 0.15),  # between (2, 0.95) and (3, 0.80)
    (POINTS, 0.6, 3.0 + 0.2 / 0.3),  # between (3, 0.80) and (4, 0.50)
    (POINTS, 0.4, 4.0),  # every rate meets it: the highest rate measured
    ([(1.0, 0.8), (2.0, 0.5)], 0.9, 0.5),  # the lowest rate misses: from (0, 1.0)
    ([(1.0, 0.95), (2.0, 0.85), (3.0, 0.92)], 0.9, 1.5),  # stop at the first miss
    ([(2.0, 0.9), (3.0, 0.7)], 0.9, 2.0),  # exactly at target counts as meeting it
])
def test_effective_throughput_interpolates_to_the_target(points, target, expected):
    assert effective_throughput(points, target) == pytest.approx(expected)


def test_effective_throughput_rejects_bad_input():
    with pytest.raises(ValueError, match="points"):
        effective_throughput([], 0.9)
    with pytest.raises(ValueError, match="target"):
        effective_throughput(POINTS, 1.5)


def _analysis(attainment: float, goodput: float, seed: int, rate: float) -> dict:
    cls = {"attainment": attainment, "goodput": goodput, "goodput_arrivals": goodput, "num": 10, "ttft_misses": 0,
           "gap_misses": 0, "median_longest_gap_ms": 100.0}
    return {"all": cls, "chat": cls, "document": cls, "seed": seed, "rate": rate}


def test_report_gives_the_baselines_bound_on_any_goodput_ratio():
    # Over one arrival window no server can beat the baseline by more than 1 / its attainment.
    from apt_serve_ray.bench.misses import report_tables

    eff = {g: {"90": 0.0, "60": 0.0} for g in ("all", "chat", "document")}
    runs = {"serve:ours": {"results": [_analysis(0.9, 0.9, 0, 1.0), _analysis(0.96, 0.96, 1, 1.0)],
                           "effective_throughput": eff, "machine": {}},
            "serve:vllm": {"results": [_analysis(0.5, 0.5, 0, 1.0), _analysis(0.8, 0.8, 1, 1.0)],
                           "effective_throughput": eff, "machine": {}}}
    text = report_tables(runs, "vllm")
    assert "| 1 | ours | 93.0% (90%-96%) | 93.0% (90%-96%) | 93.0% (90%-96%) | 1.50x (1.20-1.80) |" in text
    assert "| 1 | vllm | 65.0% (50%-80%) | 65.0% (50%-80%) | 65.0% (50%-80%) | - (at most 1.62x: 1.25-2.00) |" in text
