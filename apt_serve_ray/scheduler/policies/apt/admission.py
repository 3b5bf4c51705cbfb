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
                   lead: int = -1) -> np.ndarray:
    """Rows of requests that cannot have their first token in time (module docstring).
    ``seconds_scale``: wall seconds a second of the model's prefill takes now (the measured slowdown
    over the share of each step left to prefill beside the decodes); ``lead``: a row that goes before
    every other (the reserved one), -1: none; ``chunk_tokens``: a step's token budget."""
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
    rows, slack = rows[order], slack[order]
    left = np.maximum(c.num_tokens[rows] - c.num_computed[rows], 0)
    own = prefill_seconds(step_model, c.num_computed[rows], left, chunk_tokens) * seconds_scale
    # One by one, in that order: each written off frees its time for those behind it. Those before the
    # first one over its target are all kept.
    over = np.flatnonzero(np.cumsum(own) > slack)
    if not over.size:
        return over
    late = np.zeros(rows.size, dtype=bool)
    first = int(over[0])
    kept_s = float(own[:first].sum())
    for i, (t, s) in enumerate(zip(own[first:].tolist(), slack[first:].tolist()), first):
        if kept_s + t > s:
            late[i] = True
        else:
            kept_s += t
    return rows[late]


def reserved_row(c: Candidates, forced: np.ndarray, reserve_after: float | None) -> int:
    """The waiting row whose pages are reserved this decision (-1: none), see the module docstring."""
    n_run = c.num_running
    if reserve_after is None or c.ttft_slo_ms is None or n_run == c.num:
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
