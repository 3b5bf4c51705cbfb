"""Stage 3 of the adaptive policy (``policy.py``): running requests change kind in place.

Two directions, both "a compressed kind is a remedy for memory pressure, not a state":

* **Compress for a waiting request** (``compress_for_waiting``). With the pool full of pinned KV
  requests, a request that arrives cannot be admitted in any kind until one of them finishes or is
  evicted (a swap or a recompute, and a missed gap for it). When an int8 kind is offered, quantising
  running KV (or hidden) requests in place frees 47% of their pages (bf16) at once, and needs no free
  page to do it (``CacheManager.compress``). So when the most valuable waiting request is kept out by
  memory alone, the largest pinned requests are compressed until the pages it needs in its cheapest
  kind are freed, within the ``cache_ratio`` ceiling and the step-time headroom of the tightest TBT
  target (the int8 kinds' measured per-step cost, as ``choose.cap_compressed`` prices admissions). The
  pages come back after this step: the waiting request is admitted at the next decision.
* **Upgrade back** (``set_kinds``). Compressed running requests the knapsack wants as KV, and pinned
  compressed ones while the spare pages allow and nobody waits for memory, go back to KV (largest
  context first: it costs the most per step).

Both are work in this step: each is priced by its measured seconds per token
(``StepCosts.conversion_costs``) and done only where the step's budget (``Plan.budget``, see
``shape.py``) still has room for it; one that does not fit waits for a later step.

Functions of one ``Decision`` (``decision.py``): they read the policy's step-time model and per-kind costs.
"""

from __future__ import annotations

import numpy as np

from apt_serve_ray.scheduler.candidates import KIND_CODE, KINDS
from apt_serve_ray.scheduler.policies.apt.decision import Decision

# The int8 kind each full-precision kind is compressed to in place (index in KINDS -> index).
_COMPRESS_TO = {KIND_CODE[k]: KIND_CODE[k.compresses_to] for k in KINDS if k.compresses_to is not None}


def compress_for_waiting(d: Decision) -> int:
    """Compress pinned running requests in place so that the most valuable waiting request that
    memory keeps out fits at the next decision. Returns the pages freed (after this step)."""
    p, ctx, c, plan, offered = d.policy, d.ctx, d.c, d.plan, d.offered
    n_run = c.num_running
    targets = {src: dst for src, dst in _COMPRESS_TO.items() if dst in offered}
    if not targets or c.num == n_run or not n_run:
        return 0
    waiting = np.flatnonzero(~plan.chosen[n_run:] & (plan.value[n_run:] > 0)) + n_run
    if not waiting.size:
        return 0
    # Rather one that can still meet its SLO; the densest first.
    i = int(waiting[np.lexsort((-plan.density[waiting], c.missed[waiting]))[0]])
    need = int(c.mem[[0] + offered, i].min()) - plan.spare
    if need <= 0:
        return 0  # memory is not what keeps it out (the ceiling, the step time, the budget)
    held = c.held[:n_run]
    rows = np.flatnonzero(plan.pinned[:n_run] & np.isin(held, list(targets)))
    if not rows.size:
        return 0
    room = ctx.compressed_pages_left - compressed_admissions(d)
    headroom = kind_headroom(d)
    freed = 0
    for r in rows[np.argsort(-c.num_held[rows], kind="stable")].tolist():
        k = targets[int(held[r])]
        request = c.requests[r]
        # Pages it shares (a cached prefix) stay as they are: only its own change kind and come free.
        num, gain = ctx.cache.compress_gain(request, KINDS[k])
        cost = float(d.per_page[k] * c.mem_kv[r])
        now_s = p.costs.conversion_seconds(KINDS[int(held[r])], KINDS[k], request.num_computed_tokens)
        if gain <= 0 or num > room or cost > headroom or not plan.budget.fits(now_s):
            continue
        if ctx.compress(request, KINDS[k]):
            plan.budget.spend(now_s, extra=True)
            freed += gain
            room -= num
            headroom -= cost
            plan.kind[r] = k
            if freed >= need:
                break
    return freed

def compressed_admissions(d: Decision) -> int:
    """Compressed pages the plan gives waiting requests this step (they count against the ceiling)."""
    c, plan = d.c, d.plan
    n_run = c.num_running
    rows = np.flatnonzero(plan.chosen[n_run:] & (plan.kind[n_run:] > 0)) + n_run
    return int(c.mem[plan.kind[rows], rows].sum()) if rows.size else 0

def kind_headroom(d: Decision) -> float:
    """Seconds the predicted decode step may still grow by before it passes ``tbt_headroom`` x the
    tightest TBT target of the chosen (inf without a step-time model)."""
    p, c, plan = d.policy, d.c, d.plan
    if p.step_model is None or not plan.order.size:
        return float("inf")
    # Every chosen request's target, those that already missed included: a compressed kind slows
    # every later step (unlike one step's prefill chunk), and under overload all may have missed.
    target = p.tbt_headroom * float(c.tbt_slo_ms[plan.order].min()) / 1000.0
    decodes = c.is_decoding
    base = p.step_model.predict(int(decodes.sum()), int(c.need[decodes].sum()),
                                   int(c.need[decodes & c.is_hidden].sum()))
    return target - base - d.held_extra_s(np.flatnonzero(decodes))

def set_kinds(d: Decision) -> None:
    """Upgrades in place: running requests of a compressed kind the knapsack wants as KV, then (a
    compressed kind is a remedy for memory pressure, not a state) pinned ones while the spare pages
    allow and no waiting request is left out, largest context first (it costs the most per step)."""
    ctx, c, plan = d.ctx, d.c, d.plan
    order, kind, first = plan.order, plan.kind, plan.forced | plan.pinned
    rows = order[order < c.num_running]
    budget = plan.budget
    for i in rows[c.is_compressed[rows] & (kind[rows] == 0) & ~first[rows]].tolist():
        # An upgrade the step cannot afford waits for a later step (the request runs in its kind).
        cost = upgrade_s(d, i)
        if budget.fits(cost) and ctx.upgrade(c.requests[i]):
            budget.spend(cost, extra=True)
    if not plan.chosen[c.num_running:].all():
        return  # someone waits: the pages an upgrade takes would keep them out longer
    back = np.flatnonzero(plan.pinned & c.is_compressed)
    held = c.mem_held
    for i in back[np.argsort(-c.need[back], kind="stable")].tolist():
        cost = upgrade_s(d, i)
        if plan.spare >= c.mem_kv[i] and budget.fits(cost) and ctx.upgrade(c.requests[i]):
            budget.spend(cost, extra=True)
            plan.spare -= c.mem_kv[i] - held[i]
            kind[i] = 0

def upgrade_s(d: Decision, i: int) -> float:
    """What upgrading running row ``i`` to KV in place adds to this step."""
    c = d.c
    held = KINDS[int(c.held[i])]
    return d.policy.costs.conversion_seconds(held, held.upgrades_to, int(c.num_computed[i]))
