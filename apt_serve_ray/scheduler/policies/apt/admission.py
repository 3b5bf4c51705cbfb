"""Admission as a promise, part of the adaptive policy's stages (``policy.py``; issue 44).

Three functions over one decision's ``Candidates`` and ``Plan``, with everything they read passed in:

* ``predicted_late``: the requests without a first token (waiting, or admitted and still in prefill)
  whose first token cannot come in time even if served in the order the policy serves them (the more
  important first, then the nearest deadline) at the rate prefill runs now: each one's prefill, after
  those ahead of it that can still make theirs, would end past its TTFT target. The
  policy writes them off as it writes off a request already late (they run behind every request that
  can still pass). Under a burst of documents, first-come-first-served ran each one a little late, in
  turn (bf16, CV 4, 1 req/s: 25 of 48 documents late, median TTFT 12.3 s against 12 s); one written
  off early lets those behind it keep theirs. The estimate leaves out arrivals still to come and
  each step's fixed cost, so it errs towards "can still pass".

* ``reserved_row``: the waiting request whose pages the greedy must not share out this decision: the
  oldest that can still pass and has used ``reserve_after`` of its TTFT target. The greedy weighs value
  per page, so short requests were admitted ahead of a long, older one until its target was lost
  (documents behind a stream of chats: 5 of 11 missed their 12 s TTFT); one at a time, so a burst of
  long requests cannot take every short one's turn.
* ``admit_within_promise``: of the chosen waiting requests, the longest run in the plan's order (those
  that can still pass before the late ones) whose decode rows, added to every running request's, each
  at the context it will hold when it finishes, keep the predicted decode step within
  ``admission_share`` of the step's target; the rest wait. Under a burst the greedy started everyone
  memory allowed and then broke their gaps (at 2 req/s, 23 of 29 chats over their 0.5 s gap, none
  late): a request kept waiting still has its TTFT, one started and then stalled has lost.
"""

from __future__ import annotations

import heapq

import numpy as np

from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.candidates import KIND_CODE, Candidates
from apt_serve_ray.scheduler.knapsack import SKIP

PROMISE_LOOKAHEAD = 512  # tokens of a request's growth the promise looks ahead (max_tokens may be far off)
# Requests (in the order the policy serves them) that ``predicted_late`` weighs, one by one, each written
# off freeing its time for those behind it; those further back wait beyond what a step can reach, and
# are weighed as they come forward (bounds the decision's cost under a backlog: sorting and scanning
# all 1,600 candidates cost ~0.25 ms a decision).
LATE_WINDOW = 128
_HIDDEN = KIND_CODE[CacheKind.HIDDEN]


def int8_seconds(per_page: np.ndarray, kinds: np.ndarray, mem_kv: np.ndarray) -> np.ndarray:
    """Each row's extra decode-step seconds from holding an int8 kind (``kinds`` as in ``held``; 0 for
    KV, the hidden kind, whose recompute is the step model's own term, and rows holding nothing)."""
    return np.where(kinds > _HIDDEN, per_page[np.maximum(kinds, 0)] * mem_kv, 0.0)


def prefill_seconds(step_model, start: np.ndarray, num_tokens: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Predicted seconds of computing ``num_tokens`` tokens of each row from position ``start``, in
    chunks of at most ``chunk_tokens`` (a step's token budget), each chunk a step of its own: the
    step-time model is linear in its features, so per step, per token, per token of context at the
    chunk's end, and per query-key pair (which chunking does not change)."""
    base = step_model.predict(0, 0)
    per_token = max(step_model.predict(1, 0) - base, 1e-9)
    per_context = max(step_model.predict(0, 1) - base, 0.0)
    per_pair = max(step_model.predict(0, 0, 0, 1) - base, 0.0)
    n = num_tokens.astype(np.float64)
    steps = np.ceil(n / max(1, chunk_tokens))
    context = steps * start + chunk_tokens * steps * np.maximum(steps - 1, 0) / 2 + n  # each chunk's end
    return base * steps + per_token * n + per_context * context + per_pair * (n * start + n * (n + 1) / 2)


def predicted_late(c: Candidates, step_model, *, seconds_scale: float, chunk_tokens: int,
                   lead: int = -1, fewest: bool = True) -> np.ndarray:
    """Rows of requests that cannot have their first token in time (module docstring).
    ``seconds_scale``: wall seconds a second of the model's prefill takes now (the measured slowdown
    over the share of each step left to prefill beside the decodes); ``lead``: a row that goes before
    every other (the reserved one), -1: none; ``chunk_tokens``: a step's token budget. ``fewest``:
    within a priority, write off the fewest (Moore-Hodgson: the longest kept so far goes when one
    runs late); False: each request that does not fit after those kept, in turn."""
    if step_model is None or c.ttft_slo_ms is None or c.awaiting_first is None:
        return np.empty(0, dtype=np.int64)
    rows = np.flatnonzero(c.awaiting_first & ~c.missed)
    if not rows.size:
        return rows
    slack = c.ttft_slo_ms[rows] / 1000.0 - c.pending_s[rows]
    # The order the policy serves them in: the more important first (a document's estimate counts every
    # chat before it; a chat's, no document), then the nearest deadline; the reserved one before all.
    # Only the first LATE_WINDOW are weighed: those further back wait beyond what this step can reach.
    prio = c.priority[rows].astype(np.float64) if c.priority is not None else np.zeros(rows.size)
    key = np.where(rows == lead, -np.inf, prio * 1e6 + slack)  # slack >= 0 and far below 1e6 s
    if rows.size > LATE_WINDOW:
        head = np.argpartition(key, LATE_WINDOW - 1)[:LATE_WINDOW]
        order = head[np.argsort(key[head], kind="stable")]
    else:
        order = np.argsort(key, kind="stable")
    rows, slack, prio = rows[order], slack[order], prio[order]
    left = np.maximum(c.num_tokens[rows] - c.num_computed[rows], 0)
    own = prefill_seconds(step_model, c.num_computed[rows], left, chunk_tokens) * seconds_scale
    # One by one, in that order: each written off frees its time for those behind it. Those before the
    # first one over its target are all kept.
    over = np.flatnonzero(np.cumsum(own) > slack)
    if not over.size:
        return over
    first = int(over[0])
    late = (fewest_late if fewest else in_turn_late)(own, slack, prio, first, lead=bool(rows[0] == lead))
    return rows[late]


def in_turn_late(own: np.ndarray, slack: np.ndarray, prio: np.ndarray, first: int, *, lead: bool) -> np.ndarray:
    """Rows (in serving order) written off one by one: each that does not fit after those kept."""
    late = np.zeros(own.size, dtype=bool)
    kept_s = float(own[:first].sum())
    for i, (t, s) in enumerate(zip(own[first:].tolist(), slack[first:].tolist()), first):
        if kept_s + t > s:
            late[i] = True
        else:
            kept_s += t
    return late


def fewest_late(own: np.ndarray, slack: np.ndarray, prio: np.ndarray, first: int, *, lead: bool) -> np.ndarray:
    """Rows (in serving order: priority, then deadline) written off so that the fewest of each priority
    are, given those of the more important priorities kept before them (Moore-Hodgson's rule, optimal
    for one server in deadline order): a row is kept; while the kept run past its deadline, the longest
    kept row of its priority goes. A row that cannot fit even after the more important ones alone is
    written off at once. The lead row (the reserved one, first) goes only for a row of its priority
    whose deadline is as late as its own or later: the reservation keeps an old request from being
    traded for a stream of short ones with nearer deadlines, not from a burst of its peers.

    Written off in turn instead, a burst of documents keeps a long one that happens to come first
    and loses the shorter ones behind it, which together would have fitted in its time."""
    late = [False] * own.size
    lead_t = float(own[0]) if lead and own.size else 0.0
    # The rows before ``first`` all fit: kept, in bulk. fixed_s: the kept rows of more important
    # priorities, and the lead; group: (-seconds, -row) of the kept rows of the current priority.
    kept_s = fixed_s = 0.0
    group: list[tuple[float, int]] = []
    current, lead_kept = None, False
    if first > 0:
        current = float(prio[first - 1])
        others = np.flatnonzero(prio[:first] != current)
        start = max(int(others[-1]) + 1 if others.size else 0, 1 if lead else 0)
        kept_s, fixed_s = float(own[:first].sum()), float(own[:start].sum())
        group = list(zip((-own[start:first]).tolist(), range(-start, -first, -1)))
        heapq.heapify(group)
        lead_kept = lead
    prios, lead_prio, lead_slack = prio.tolist(), float(prio[0]), float(slack[0])
    for i, (t, s) in enumerate(zip(own[first:].tolist(), slack[first:].tolist()), first):
        if prios[i] != current:
            current, fixed_s, group = prios[i], kept_s, []
        tradable = lead_kept and prios[i] == lead_prio and s >= lead_slack
        if fixed_s - (lead_t if tradable else 0.0) + t > s:
            late[i] = True
            continue
        if kept_s + t > s and (not group or -group[0][0] <= t) and not (tradable and lead_t > t):
            late[i] = True  # the longest it could go for is itself: late without a push and a pop
            continue
        kept_s += t
        if i == 0 and lead:
            fixed_s += t
            lead_kept = True
            continue
        heapq.heappush(group, (-t, -i))  # of two as long, the later one goes
        while kept_s > s:  # ends by the time only row i is left
            if tradable and (not group or lead_t >= -group[0][0]):
                late[0], lead_kept, tradable = True, False, False
                kept_s -= lead_t
                fixed_s -= lead_t
                continue
            neg, j = heapq.heappop(group)
            late[-j] = True
            kept_s += neg
    return np.array(late, dtype=bool)


def reserved_row(c: Candidates, forced: np.ndarray, reserve_after: float | None, keep=None) -> int:
    """The row whose pages are reserved this decision (-1: none), see the module docstring. ``keep``:
    the request reserved at the last decision; once admitted it keeps the lead until its first token
    (or until it can no longer pass). Passed on as soon as it was admitted, the lead went to the next
    oldest at every step, whose first chunk then led that step: a burst of documents each got a chunk
    in turn and most ran late (simulated, 12 documents of 900-1,500 tokens 0.2 s apart, 6 s TTFT: 3
    met; kept to its first token, 5; with the fewest written off too, 6; with no reservation, 7:
    ``tests/scheduler/test_step_shaping.py``)."""
    n_run = c.num_running
    if reserve_after is None or c.ttft_slo_ms is None:
        return -1
    if keep is not None and c.awaiting_first is not None:
        for i in range(n_run):
            if c.requests[i] is keep:
                if c.awaiting_first[i] and not c.missed[i] and not forced[i]:
                    return i
                break
    if n_run == c.num:
        return -1
    waited = c.pending_s[n_run:] >= reserve_after * c.ttft_slo_ms[n_run:] / 1000.0
    rows = np.flatnonzero(waited & ~c.missed[n_run:] & ~forced[n_run:]) + n_run
    return int(rows[np.argmin(c.arrival[rows])]) if rows.size else -1


def admit_within_promise(c: Candidates, plan, reserved: int, *, step_model, per_page: np.ndarray,
                         admission_share: float, target_scale: float) -> None:
    """Drop from ``plan`` the chosen waiting rows the step's promise cannot afford (module docstring).
    ``target_scale``: seconds of step a millisecond of TBT target buys (``tbt_headroom`` / the measured
    slowdown, / 1000). The protected (``plan.forced``) are not held back and count as rows; the reserved
    one leads the rest; with nothing running, the first starts whatever it costs."""
    n_run, order, kind = c.num_running, plan.order, plan.kind
    new = order[order >= n_run]
    new = new[~plan.forced[new]]
    if not new.size:
        return
    rows = np.concatenate((np.flatnonzero(plan.chosen[:n_run]), order[(order >= n_run) & ~np.isin(order, new)]))
    need, tbt = c.need, c.tbt_slo_ms
    if c.max_num_tokens is not None:  # the context each will hold when it finishes
        need = np.minimum(np.maximum(c.max_num_tokens, need), need + PROMISE_LOOKAHEAD)
    row_kind = np.where(rows < n_run, c.held[rows], kind[rows])
    live = rows[~c.missed[rows]]
    tight = float(tbt[live].min()) if live.size else np.inf
    late = c.missed[new] & (new != reserved)
    new = np.concatenate((new[~late], new[late]))  # those that can still pass first
    k = kind[new]
    n_rows = rows.size + np.arange(1, new.size + 1)
    ctx = int(need[rows].sum()) + np.cumsum(need[new])
    hidden = int(need[rows][row_kind == _HIDDEN].sum()) + np.cumsum(np.where(k == _HIDDEN, need[new], 0))
    extra = (float(int8_seconds(per_page, row_kind, c.mem_kv[rows]).sum())
             + np.cumsum(int8_seconds(per_page, k, c.mem_kv[new])))
    predicted = np.asarray(step_model.predict(n_rows, ctx, hidden), dtype=np.float64) + extra
    limit = np.minimum.accumulate(np.where(c.missed[new], tight, np.minimum(tight, tbt[new])))
    over = np.flatnonzero(predicted > admission_share * target_scale * limit)
    if not over.size:
        return
    dropped = new[int(over[0]) if rows.size or over[0] > 0 else 1:]
    if not dropped.size:
        return
    plan.spare += int(c.mem[np.maximum(kind[dropped], 0), dropped].sum())
    plan.chosen[dropped] = False
    kind[dropped] = SKIP
    plan.order = order[plan.chosen[order]]
