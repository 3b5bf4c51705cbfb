"""Stage 4 of the adaptive policy (``policy.py``): shape the iteration from the plan ``choose`` made.

Who runs this step, in which order, with how many prefill tokens, and whom to preempt when pages run
short; and the step's budget (``step_budget``), set once the plan is made. Functions of one
``Decision`` (``decision.py``): they read the policy's step-time model, slowdown and protected set.
"""

from __future__ import annotations

import math

import numpy as np

from apt_serve_ray.request import CacheKind, RequestStatus
from apt_serve_ray.scheduler.candidates import KIND_CODE, KINDS, Candidates
from apt_serve_ray.scheduler.costs import rows_features
from apt_serve_ray.scheduler.policies.apt.decision import Decision, StepBudget
from apt_serve_ray.scheduler.policies.base import run_running

# The prefill loop stops where nothing more can run (False: it sizes a chunk for every row, as it did
# before issue 44; the same decisions, tests/scheduler/test_step_shaping.py holds the two together).
EARLY_STOP = True


def shape(d: Decision) -> None:
    """Run the chosen: decodes, then prefill chunks sized so that the step keeps its promise to the
    decoding requests that can still pass (``plan.budget``), then unchosen running requests."""
    p, ctx, c, plan = d.policy, d.ctx, d.c, d.plan
    n_run, order = c.num_running, plan.order
    is_decode = c.is_decoding[order]
    decodes, prefills = order[is_decode].tolist(), order[~is_decode].tolist()
    # Victims when pages run short: unchosen first, then (only for running requests' growth) the
    # least important (the largest priority value), among them those that already missed, then the
    # rest; lowest density first; never the protected. (Missed-first alone made an important request
    # that missed one gap the next victim of an unimportant one's growth, and preempted it again and
    # again: 5-18 preemptions per interactive request in a 30% / 70% mix at 1.5x capacity.)
    running = np.flatnonzero(~plan.forced[:n_run])
    prio = c.priority[running] if c.priority is not None else np.zeros(running.size)
    victims = running[np.lexsort((plan.density[running], ~c.missed[running], -prio,
                                  plan.chosen[running]))].tolist()
    unchosen = np.flatnonzero(~plan.chosen[:n_run])
    evictable = set(unchosen.tolist())
    # Decodes first, those that can still pass before those that cannot (one token each: the
    # token budget never splits them), then the prefill chunks in the plan's order, each as long
    # as the step's time left allows.
    decodes.sort(key=lambda i: bool(c.missed[i]))
    run(d, plan.kind, decodes, ctx.token_budget, victims, evictable)
    progressed = run_prefills(d, prefills, victims, evictable, floor=True)
    # Unchosen running requests still holding pages go on: decodes while the token budget lasts,
    # prefill chunks within what is left of the step's time.
    run(d, plan.kind, unchosen[c.is_decoding[unchosen]].tolist(), ctx.token_budget, [], set())
    run_prefills(d, unchosen[~c.is_decoding[unchosen]].tolist(), [], set(), floor=not progressed)
    ctx.planned_extra_s = plan.budget.extra_s
    if ctx.num_scheduled == 0 and ctx.running:
        # Liveness: page estimates can be off by rounding; never let a step schedule nothing
        # while requests hold memory. Fall back to preempting the lowest-value running request.
        rank = {id(c.requests[i]): plan.density[i] for i in range(n_run)}
        key = lambda r: (r not in p.protected, -rank.get(id(r), 0.0))  # noqa: E731
        run_running(ctx, sorted(ctx.running, key=key), victim_key=key, chunked=True)


def step_budget(d: Decision) -> StepBudget:
    """The step's budget before any kind change: the target over the running requests that decode
    this step, in the model's seconds (divided by how much slower than predicted steps have run
    lately, ``observe_step``), less their predicted decode rows (with what their int8 pages add)."""
    p, c = d.policy, d.c
    rows = np.flatnonzero(c.is_decoding[: c.num_running])
    target = d.step_target(rows) if p.step_model is not None else None
    # The int8 rows' dequantisation is not in the step-time model's features: it is spent as extra,
    # so that the step's prediction (chunks + extra) counts it too. Left out, mixed steps with int8
    # rows read as steps slower than predicted (1.24x at the median, bf16) and the learnt slowdown
    # then charged every later step for it a second time.
    held_s = d.held_extra_s(rows) if p.step_model is not None else 0.0
    if target is None:
        return StepBudget(None, math.inf, extra_s=held_s)
    budget = StepBudget(target, target / p.slowdown - d.decode_seconds(rows))
    budget.spend(held_s, extra=True)
    budget.spend(sampling_extra_s(p.sampling_costs, c, rows), extra=True)
    return budget


def sampling_extra_s(sampling_costs: tuple[float, float], c: Candidates, rows) -> float:
    """What the sampler's extra work (``observe_sampling``'s costs a row) adds to a step of ``rows``."""
    mask_s, adjust_s = sampling_costs
    if not (mask_s or adjust_s):
        return 0.0
    params = [c.requests[i].sampling_params for i in rows.tolist()]
    return (mask_s * sum(p.structured_output is not None for p in params)
            + adjust_s * sum(p.adjusts_logits for p in params))


def run_prefills(d: Decision, rows: list[int], victims: list[int], evictable: set[int], *, floor: bool) -> bool:
    """Prefill chunks of ``rows`` in order, each of the most tokens whose predicted time fits what is
    left of the step's budget (a request coming back from the tier also pays its pages' way in);
    without a promise to keep, the token budget alone. With ``floor``, the first chunk that runs
    gets at least one page's worth, so prefill progresses even when the decodes alone fill the
    step. Returns whether any chunk ran."""
    p, ctx, c, plan = d.policy, d.ctx, d.c, d.plan
    budget = plan.budget
    if budget.target_s is None:
        before = ctx.num_scheduled
        run(d, plan.kind, rows, ctx.token_budget, victims, evictable)
        return ctx.num_scheduled > before
    n_run, progressed = c.num_running, False
    page = ctx.cache.layout.block_size
    transfer = getattr(getattr(ctx.cache, "swap", None), "transfer", None)
    hidden_code = KIND_CODE[CacheKind.HIDDEN]
    # No chunk costs less than one token at a prompt's start (where the model grows with context
    # and the hidden kind: a fitted model with a negative term keeps the search over every row).
    cheapest_s = chunk_s(p.step_model, 0, 1, False)
    if not cheapest_s <= min(chunk_s(p.step_model, 1 << 16, 1, False), chunk_s(p.step_model, 0, 1, True)):
        cheapest_s = -math.inf
    for i in rows:
        if EARLY_STOP and (ctx.num_seqs_left <= 0 or ctx.token_budget <= 0):
            break  # nothing more can run this step (the plan may hold hundreds of waiting rows)
        if EARLY_STOP and (progressed or not floor) and budget.left_s < cheapest_s:
            break  # no chunk fits what is left of the step
        r = c.requests[i]
        if r.is_finished or ctx.is_scheduled(r):
            continue
        start, left = r.num_computed_tokens, r.num_tokens_to_compute
        if r.kind is None:  # holds nothing: it starts after what the prefix cache holds in its kind
            start = ctx.prefix_hit(r, KINDS[max(int(plan.kind[i]), 0)])[0]
            left -= start
        # The kind it runs in: what it holds, or (new, or back from the tier) what the plan chose.
        hidden = bool(c.held[i] == hidden_code) if i < n_run and r.page_ids else plan.kind[i] == hidden_code
        swap_in_s = len(r.swap_slots) * transfer.in_s_per_page if (r.swap_slots and transfer) else 0.0
        limit = min(left, ctx.token_budget)
        n = chunk_fitting(p.step_model, start, budget.left_s - swap_in_s, hidden, limit)
        if floor and not progressed:
            n = max(n, min(page, limit))
        if n <= 0:
            continue  # another (shallower) chunk may still fit
        run(d, plan.kind, [i], n, victims, evictable)
        if ctx.is_scheduled(r):
            progressed = True
            budget.spend(chunk_s(p.step_model, start, ctx.scheduled_tokens(r), hidden))
            if ctx.is_swapping_in(r):
                budget.spend(swap_in_s, extra=True)
    return progressed


def predict(step_model, rows: list[tuple[int, int, bool]]) -> float:
    """Predicted seconds of a step of ``(start, tokens, hidden)`` rows."""
    return step_model.predict(*rows_features(rows))


def chunk_s(step_model, start: int, n: int, hidden: bool) -> float:
    """What a prefill chunk of ``n`` tokens from ``start`` adds to a step."""
    return predict(step_model, [(start, n, hidden)]) - predict(step_model, [])


def chunk_fitting(step_model, start: int, seconds: float, hidden: bool, limit: int) -> int:
    """The most tokens (at most ``limit``) a chunk from ``start`` may have while adding at most
    ``seconds`` (0 if none): the chunk's time rises with its tokens, so bisect."""
    if limit <= 0 or seconds <= 0 or chunk_s(step_model, start, 1, hidden) > seconds:
        return 0
    if chunk_s(step_model, start, limit, hidden) <= seconds:
        return limit
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_s(step_model, start, mid, hidden) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


def run(d: Decision, kinds: np.ndarray, rows: list[int], budget: int, victims: list[int], evictable: set[int]) -> None:
    """Schedule ``rows`` in order while ``budget`` tokens last; when pages are short, preempt
    ``victims`` in order (for a waiting request, only the ``evictable`` ones)."""
    ctx, c = d.ctx, d.c
    requests, n_run = c.requests, c.num_running
    for i in rows:
        if budget <= 0 or ctx.num_seqs_left <= 0:
            return  # neither comes back within this loop: nothing later could run
        r = requests[i]
        if r.is_finished or ctx.is_scheduled(r):
            continue
        if r.status is RequestStatus.WAITING and (i < n_run or not ctx.can_admit(r)):
            continue  # preempted during this decision, or admission closed
        kind = None
        if r.kind is None or r.swap_slots:  # new, or back from the tier: the chosen kind, else the kind
            kind = KINDS[kinds[i]] if kinds[i] > 0 else CacheKind.KV  # its cached prefix is in, else KV
            if kinds[i] <= 0 and c.hit_kind is not None and c.hit_kind[i] > 0 \
                    and KINDS[c.hit_kind[i]] in ctx.compressed_kinds:
                kind = KINDS[c.hit_kind[i]]
        n = min(ctx.tokens_to_compute(r, kind), budget, ctx.token_budget)
        if n <= 0:
            continue
        while not ctx.schedule(r, n, kind):
            victim = next_victim(requests, victims, r, None if i < n_run else evictable)
            if victim is None or ctx.cache.can_allocate(r, r.num_computed_tokens + n, kind):
                break
            victims.remove(victim)
            ctx.preempt(requests[victim], cause="policy" if i >= n_run else "memory")
        else:
            budget -= ctx.scheduled_tokens(r)


def next_victim(requests, victims: list[int], r, evictable: set[int] | None) -> int | None:
    """The first running victim other than ``r`` (among ``evictable`` only, unless None). The
    evictable ones, the unchosen, lead the list (``shape`` sorts them first), so the search for a
    waiting request stops where they end: scanning every victim for every waiting request that
    does not fit was quadratic (0.9 s of a 6,400-candidate decision)."""
    for v in victims:
        if evictable is not None and v not in evictable:
            return None
        if requests[v].status is RequestStatus.RUNNING and requests[v] is not r:
            return v
    return None
