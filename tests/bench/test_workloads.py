"""Request traces: documented length distributions, Gamma arrivals, reproducibility, JSONL round trip."""

import math

import numpy as np
import pytest

from apt_serve_ray.bench.mixed_trace import MIXED, make_mixed_trace
from apt_serve_ray.bench.rate_shapes import Diurnal, OnOff, arrival_rates, make_shaped_trace
from apt_serve_ray.bench.workloads import (
    WORKLOADS,
    ServiceClass,
    TraceRequest,
    assign_classes,
    fill_token_ids,
    load_trace,
    make_random_trace,
    make_trace,
    save_trace,
    with_rate,
)


def lengths(trace):
    return (np.array([r.prompt_len for r in trace]), np.array([r.output_len for r in trace]))


@pytest.mark.parametrize("workload", ["sharegpt", "longbench", "humaneval"])
def test_sample_medians_match_the_documented_log_normals(workload):
    spec = WORKLOADS[workload]
    prompt, output = lengths(make_trace(workload, 5000, rate=1.0, seed=3))
    # Clipping to max_model_len only cuts the upper tail, so medians keep their documented values.
    assert np.median(prompt) == pytest.approx(spec.prompt.median, rel=0.06)
    assert np.median(output) == pytest.approx(spec.output.median, rel=0.06)
    log_output = np.log(output)
    assert log_output.std() == pytest.approx(spec.output.sigma, rel=0.1)


def test_sharegpt_has_a_long_tail_and_longbench_long_prompts():
    prompt, output = lengths(make_trace("sharegpt", 5000, rate=1.0, seed=0))
    assert prompt.mean() > 1.4 * np.median(prompt)
    assert np.percentile(prompt, 99) > 1500
    prompt, output = lengths(make_trace("longbench", 5000, rate=1.0, seed=0))
    assert 900 < np.percentile(prompt, 5) and np.percentile(prompt, 50) > 1300
    assert 40 < np.percentile(output, 5) and np.percentile(output, 95) < 180


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("max_model_len", [2048, 256])
def test_lengths_fit_the_model(workload, max_model_len):
    prompt, output = lengths(make_trace(workload, 2000, rate=1.0, max_model_len=max_model_len))
    assert (prompt >= 1).all() and (output >= 1).all()
    assert (prompt + output <= max_model_len).all()


def test_random_workload_is_uniform_in_the_range_ratio_band():
    prompt, output = lengths(make_random_trace(5000, rate=1.0, input_len=384, output_len=128, range_ratio=0.5))
    assert prompt.min() >= 192 and prompt.max() <= 576
    assert output.min() >= 64 and output.max() <= 192
    assert prompt.mean() == pytest.approx(384, rel=0.02)
    prompt, output = lengths(make_random_trace(10, rate=1.0, input_len=100, output_len=7))
    assert (prompt == 100).all() and (output == 7).all()


def test_same_seed_same_trace_other_seed_other_trace():
    a = make_trace("sharegpt", 200, rate=2.0, cv=2.0, seed=7, vocab_size=1000)
    assert a == make_trace("sharegpt", 200, rate=2.0, cv=2.0, seed=7, vocab_size=1000)
    b = make_trace("sharegpt", 200, rate=2.0, cv=2.0, seed=8, vocab_size=1000)
    assert lengths(a)[0].tolist() != lengths(b)[0].tolist()
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert a[0].prompt_token_ids != b[0].prompt_token_ids


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_gaps_have_the_requested_cv_and_rate(cv):
    trace = make_trace("humaneval", 20_000, rate=4.0, cv=cv, seed=1)
    arrivals = np.array([r.arrival_s for r in trace])
    assert arrivals[0] == 0.0  # the first request is sent at once, as vllm bench serve does
    gaps = np.diff(arrivals)
    assert (gaps >= 0).all()
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.12)
    assert (len(gaps) / arrivals[-1]) == pytest.approx(4.0, rel=0.05 * cv)


def test_infinite_rate_sends_everything_at_once():
    assert {r.arrival_s for r in make_trace("humaneval", 50, rate=math.inf)} == {0.0}


def test_with_rate_retimes_the_same_requests_as_make_trace_would():
    slow = make_trace("longbench", 100, rate=0.5, cv=2.0, seed=4)
    fast = with_rate(slow, rate=2.0, cv=2.0, seed=4)
    assert fast == make_trace("longbench", 100, rate=2.0, cv=2.0, seed=4)
    assert lengths(fast)[0].tolist() == lengths(slow)[0].tolist()
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)


def test_token_ids_have_exact_prompt_lengths_and_stay_in_range():
    trace = make_trace("humaneval", 100, rate=1.0, vocab_size=500)
    for r in trace:
        assert len(r.prompt_token_ids) == r.prompt_len
        assert 10 <= min(r.prompt_token_ids) and max(r.prompt_token_ids) < 490
    assert make_trace("humaneval", 3, rate=1.0)[0].prompt_token_ids is None
    assert fill_token_ids(trace, vocab_size=50_000) == trace  # ids already present are kept


def test_jsonl_round_trip_is_exact(tmp_path):
    trace = make_trace("sharegpt", 50, rate=3.3, cv=1.7, seed=2, vocab_size=2000)
    trace.append(TraceRequest("custom", 1 / 3, 2, 5, [11, 12], ttft_slo_ms=250.5, tbt_slo_ms=50.0, priority=2))
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert len(path.read_text().splitlines()) == len(trace)
    assert load_trace(path) == trace


def test_load_trace_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "a", "arrival_s": 0, "prompt_len": 1, "output_len": 1}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(path)


@pytest.mark.parametrize("kwargs, field", [
    (dict(workload="alpaca"), "sharegpt"),
    (dict(rate=0.0), "rate"),
    (dict(rate=-1.0), "rate"),
    (dict(cv=0.0), "cv"),
    (dict(num_requests=0), "num_requests"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(vocab_size=20), "vocab_size"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    args = dict(workload="sharegpt", num_requests=10, rate=1.0) | kwargs
    with pytest.raises(ValueError, match=field):
        make_trace(**args)


@pytest.mark.parametrize("kwargs, field", [
    (dict(range_ratio=1.0), "range_ratio"),
    (dict(input_len=0), "input_len"),
    (dict(output_len=0), "output_len"),
])
def test_bad_random_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_random_trace(10, 1.0, **kwargs)


def test_output_cap_keeps_the_rest_of_the_trace():
    full = make_trace("sharegpt", 50, 2.0, seed=4, max_model_len=1024)
    capped = make_trace("sharegpt", 50, 2.0, seed=4, max_model_len=1024, max_output_len=64)
    assert [r.output_len for r in capped] == [min(r.output_len, 64) for r in full]
    assert [(r.prompt_len, r.arrival_s) for r in capped] == [(r.prompt_len, r.arrival_s) for r in full]
    assert any(r.output_len > 64 for r in full)


INTERACTIVE = ServiceClass("interactive", 0.3, ttft_slo_ms=1000, tbt_slo_ms=100, priority=0)
BATCH = ServiceClass("batch", 0.7, ttft_slo_ms=30000, tbt_slo_ms=1000, priority=10)


def test_classes_get_exact_shares_and_their_slos_and_priority():
    trace = assign_classes(make_trace("sharegpt", 150, 1.0, seed=2), [INTERACTIVE, BATCH], seed=2)
    by_class = {c.name: [r for r in trace if r.service_class == c.name] for c in (INTERACTIVE, BATCH)}
    assert {name: len(rs) for name, rs in by_class.items()} == {"interactive": 45, "batch": 105}
    for c in (INTERACTIVE, BATCH):
        assert {(r.ttft_slo_ms, r.tbt_slo_ms, r.priority) for r in by_class[c.name]} == {
            (c.ttft_slo_ms, c.tbt_slo_ms, c.priority)}


def test_uneven_shares_round_by_largest_remainder():
    trace = assign_classes(make_trace("sharegpt", 10, 1.0), [
        ServiceClass("a", 0.26, 1, 1), ServiceClass("b", 0.34, 1, 1), ServiceClass("c", 0.4, 1, 1)])
    counts = {name: sum(r.service_class == name for r in trace) for name in "abc"}
    assert counts == {"a": 3, "b": 3, "c": 4}  # 2.6 / 3.4 / 4.0: the one left goes to the largest remainder


def test_classes_are_seeded_mixed_and_leave_lengths_and_arrivals_alone():
    base = make_trace("longbench", 60, 0.5, seed=1)
    a, b = (assign_classes(base, [INTERACTIVE, BATCH], seed=7) for _ in range(2))
    other = assign_classes(base, [INTERACTIVE, BATCH], seed=8)
    labels = [r.service_class for r in a]
    assert labels == [r.service_class for r in b]
    assert labels != [r.service_class for r in other]
    assert labels[:18] != ["interactive"] * 18  # spread over the trace, not the first 30%
    assert [(r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in a] == [
        (r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in base]
    # Re-timing keeps the classes (with_rate replaces arrivals only).
    assert [r.service_class for r in with_rate(a, 2.0, seed=1)] == labels


def test_a_mixed_trace_gives_each_class_its_own_lengths_slos_and_priority():
    trace = make_mixed_trace(MIXED, 200, rate=0.5, cv=3.0, seed=5, vocab_size=1000)
    chats = [r for r in trace if r.service_class == "chat"]
    docs = [r for r in trace if r.service_class == "document"]
    assert (len(chats), len(docs)) == (140, 60)  # exact shares
    assert all(64 <= r.prompt_len <= 256 and 32 <= r.output_len <= 128 for r in chats)
    assert all(900 <= r.prompt_len <= 1500 and 64 <= r.output_len <= 128 for r in docs)
    assert {(r.ttft_slo_ms, r.tbt_slo_ms, r.priority) for r in chats} == {(2000, 500, 0)}
    assert {(r.ttft_slo_ms, r.tbt_slo_ms, r.priority) for r in docs} == {(12000, 1000, 10)}
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in trace)
    assert trace == make_mixed_trace(MIXED, 200, rate=0.5, cv=3.0, seed=5, vocab_size=1000)  # seeded
    gaps = np.diff([r.arrival_s for r in trace])
    assert gaps.std() / gaps.mean() > 2.0  # bursty (CV 3)
    # Re-timed for another rate: the same requests (with_rate), as a rate sweep needs.
    slower = with_rate(trace, 0.25, cv=3.0, seed=5)
    assert [(r.request_id, r.prompt_len) for r in slower] == [(r.request_id, r.prompt_len) for r in trace]
    # Lengths are fitted to the model as make_trace fits them.
    short = make_mixed_trace(MIXED, 50, rate=1.0, seed=1, max_model_len=1024)
    assert all(r.prompt_len + r.output_len <= 1024 for r in short)


def test_the_class_stream_leaves_older_draws_unchanged():
    # Lengths, gaps and token ids of a seed are what they were before the class stream was added.
    # (Values drawn before the change.)
    trace = make_trace("sharegpt", 3, 1.0, seed=0, vocab_size=100)
    assert [r.prompt_len for r in trace] == [847, 82, 417]
    assert trace[1].arrival_s == pytest.approx(0.8031044072628015, rel=1e-12)
    assert trace[0].prompt_token_ids[:5] == [62, 77, 47, 16, 89]


@pytest.mark.parametrize("classes, field", [
    ([ServiceClass("a", 0.5, 1, 1)], "sum to 1"),
    ([ServiceClass("a", 0.5, 1, 1), ServiceClass("a", 0.5, 1, 1)], "distinct"),
    ([], "at least one"),
])
def test_bad_class_lists_are_refused(classes, field):
    with pytest.raises(ValueError, match=field):
        assign_classes(make_trace("sharegpt", 10, 1.0), classes)


def test_bad_class_fields_name_the_field():
    with pytest.raises(ValueError, match="share"):
        ServiceClass("a", 0.0, 1, 1)
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        ServiceClass("a", 0.5, 0, 1)


def test_classes_survive_a_jsonl_round_trip(tmp_path):
    trace = assign_classes(make_trace("sharegpt", 20, 1.0), [INTERACTIVE, BATCH])
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


# Peaks ------------------------------------------------------------------------------------------
def test_on_off_arrivals_follow_the_square_wave():
    shape = OnOff(low=1.0, high=7.0, period_s=20.0)
    trace = make_shaped_trace("sharegpt", 2000, shape, seed=3)
    t = np.array([r.arrival_s for r in trace])
    high = (t % 20.0) >= 10.0
    assert high.mean() == pytest.approx(7 / 8, abs=0.03)  # the high phase's share of the arrivals
    duration = t[-1]
    assert len(trace) / duration == pytest.approx(shape.mean_rate, rel=0.08)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)


def test_diurnal_arrivals_follow_the_sine_from_its_trough():
    shape = Diurnal(mean=4.0, amplitude=0.8, period_s=60.0)
    rates = arrival_rates(make_shaped_trace("sharegpt", 3000, shape, seed=1), bin_s=5.0)
    per_period = rates[: len(rates) // 12 * 12].reshape(-1, 12).mean(axis=0)  # 12 bins of 5 s a period
    assert per_period[:2].mean() < 2.0 and per_period[5:7].mean() > 6.0  # trough first, crest mid-period
    assert rates.mean() == pytest.approx(4.0, rel=0.1)


def test_shaped_traces_are_deterministic_and_keep_make_traces_lengths():
    shape = OnOff(0.5, 4.0, 30.0, duty=0.25)
    a, b = make_shaped_trace("humaneval", 200, shape, cv=4.0, seed=7), make_shaped_trace("humaneval", 200, shape, cv=4.0, seed=7)
    assert a == b and a != make_shaped_trace("humaneval", 200, shape, cv=4.0, seed=8)
    plain = make_trace("humaneval", 200, shape.mean_rate, seed=7)
    assert [r.prompt_len for r in a] == [r.prompt_len for r in plain]


@pytest.mark.parametrize("make, field", [
    (lambda: OnOff(-1.0, 2.0, 10.0), "low/high"), (lambda: OnOff(1.0, 2.0, 0.0), "period_s"),
    (lambda: OnOff(1.0, 2.0, 10.0, duty=1.0), "duty"), (lambda: Diurnal(0.0, 0.5, 10.0), "mean"),
    (lambda: Diurnal(1.0, 1.5, 10.0), "amplitude"), (lambda: make_shaped_trace("sharegpt", 10, OnOff(1, 2, 10), cv=0), "cv"),
])
def test_bad_shapes_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# Conversations (issue 27) ---------------------------------------------------------------------------
def test_sessions_share_system_prompts_and_documents_and_fit_the_context():
    from apt_serve_ray.bench.conversations import CHAT, DOCUMENT, ConversationSpec, make_sessions, shared_token_share

    spec = ConversationSpec(num_sessions=60, max_model_len=1500)
    sessions = make_sessions(spec, rate=0.5, seed=3)
    again = make_sessions(spec, rate=2.0, seed=3)
    assert [s.messages for s in sessions] == [s.messages for s in again]  # the rate re-times, nothing else
    assert sessions[-1].start_s > again[-1].start_s
    chats = [s for s in sessions if s.service is CHAT]
    docs = [s for s in sessions if s.service is DOCUMENT]
    assert chats and docs and len({id(s.prefix) for s in chats}) <= spec.num_groups
    assert all(len(d.messages) == 1 and not d.think_s for d in docs)
    for s in chats:
        total = len(s.prefix) + sum(len(m) + o for m, o in zip(s.messages, s.output_lens))
        assert total < spec.max_model_len or s.num_turns == 1
        assert len(s.think_s) == s.num_turns - 1 and s.num_turns <= spec.turns.high
    assert 0.5 < shared_token_share(sessions) < 1.0
    with pytest.raises(ValueError, match="chat_share"):
        make_sessions(ConversationSpec(chat_share=1.5), 1.0)


def test_relabelled_sessions_keep_their_shape_in_tokens_of_their_own():
    """prefix_reuse.py runs several rates on one server: each rate's sessions in other tokens, so none
    finds what the rate before it cached, while lengths, timing and sharing stay as generated."""
    from apt_serve_ray.bench.conversations import ConversationSpec, make_sessions, relabel, shared_token_share

    spec = ConversationSpec(num_sessions=20)
    base = make_sessions(spec, 0.3, seed=4)
    one, other = relabel(base, 1, spec.vocab_size), relabel(base, 2, spec.vocab_size)
    assert shared_token_share(one) == shared_token_share(base) > 0.5
    for b, s in zip(base, one):
        assert (b.start_s, b.output_lens, len(b.prefix), [len(m) for m in b.messages]) == \
               (s.start_s, s.output_lens, len(s.prefix), [len(m) for m in s.messages])
    pages = lambda sessions: {tuple(s.prefix[:16]) for s in sessions}  # noqa: E731
    assert not pages(one) & pages(base) and not pages(one) & pages(other)
    assert relabel(base, 1, spec.vocab_size)[0].prefix == one[0].prefix  # the same key, the same tokens


def test_fresh_token_ids_keep_the_trace_and_share_no_prompt_across_rates_or_seeds():
    from apt_serve_ray.bench.workloads import fill_token_ids, fresh_token_ids, make_trace, with_rate

    base = fill_token_ids(make_trace("sharegpt", 30, 1.0, seed=4, max_model_len=2048), 49152, seed=4)
    a = fresh_token_ids(with_rate(base, 0.5, seed=4), 49152, seed=4, rate=0.5)
    b = fresh_token_ids(with_rate(base, 1.0, seed=4), 49152, seed=4, rate=1.0)
    c = fresh_token_ids(with_rate(base, 0.5, seed=5), 49152, seed=5, rate=0.5)
    assert a == fresh_token_ids(with_rate(base, 0.5, seed=4), 49152, seed=4, rate=0.5)  # reproducible
    for other in (b, c):
        assert [len(r.prompt_token_ids) for r in other] == [r.prompt_len for r in base]
        # No page-sized run of one rate's prompts appears at the start of another's.
        heads = {tuple(r.prompt_token_ids[:16]) for r in a}
        assert not heads & {tuple(r.prompt_token_ids[:16]) for r in other}
    assert [r.arrival_s for r in a] == [r.arrival_s for r in with_rate(base, 0.5, seed=4)]
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in base]
