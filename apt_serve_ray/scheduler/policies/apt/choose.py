"""Stage 2 of the adaptive policy: choose who holds memory this step, and in which kind
(``policy.py``'s docstring, stage 2): the protected and the pinned first, the reserved request's
pages kept out, the multiple-choice knapsack over the rest, compressed kinds capped by step time,
priority overtakes, and admission as a promise (``admission.py``).
"""

from __future__ import annotations

import numpy as np

from apt_serve_ray.cache.cache_manager import can_convert
from apt_serve_ray.scheduler.candidates import KINDS, NO_PAGES
from apt_serve_ray.scheduler.costs import recompute_seconds
from apt_serve_ray.scheduler.knapsack import SKIP, greedy_choice
from apt_serve_ray.scheduler.policies.apt.admission import admit_within_promise, reserved_row
from apt_serve_ray.scheduler.policies.apt.decision import Decision, Plan
from apt_serve_ray.scheduler.policies.apt.price import eviction_seconds

_COMPRESSED = np.array([k.is_compressed for k in KINDS])
# [copy's kind, kind] -> whether a copy in the tier comes back in that kind without a recompute.
_COMES_BACK_AS = np.array([[can_convert(a, b) for b in KINDS] for a in KINDS])


def choose(d: Decision) -> Plan:
    """The plan (``d.plan``): who holds memory this step and in which kind (``policy.py``, stage 2)."""
    p, ctx, c = d.policy, d.ctx, d.c
    value, kind_weight, offered = d.value, d.kind_weight, d.offered
    n, n_run = c.num, c.num_running
    forced = protected_rows(d)
    pinned = np.zeros(n, dtype=bool)
    pinned[:n_run] = ~forced[:n_run] & (~c.missed[:n_run] if p.evict_missed else True)
    # Memory the pinned and forced take first, in their current kind (KV for new forced ones).
    reserved = reserved_row(c, forced, p.reserve_after, p.reserved)
    first = forced | pinned
    if reserved >= 0:
        first[reserved] = True
    first_mem = c.mem_held
    current = c.current  # waiting requests with a copy in the tier: its kind (swapped back in it)
    # One page of growth is reserved per running request, so admissions do not force memory
    # preemptions a few steps later (measured: 47 -> 14 preemptions, ShareGPT 4 req/s, simulated). Their
    # peak need over the next 128 tokens each was tried (issue 44) and lost through Serve at CV 3, 2 req/s:
    # 83.6 / 92.9 / 62.0% against 90.6 / 97.6 / 74.1% (all / chats / documents, 3 seeds): documents then
    # waited for pages past their TTFT more often than growth had preempted them.
    capacity = ctx.num_free_pages + int(c.num_held[:n_run].sum()) - int(first_mem[first].sum()) - n_run
    rest = np.flatnonzero(~first)
    held = current[rest]
    comp_rest = held > 0
    # Options (columns): KV for every row; each offered kind for waiting rows; for running rows in
    # the knapsack, the kind they hold too (stay, or upgrade to KV), and for waiting ones with a
    # copy in the tier, the copy's kind (swap it back in). Only kinds in use get a column.
    kinds = [0] + sorted(set(offered).union(held[comp_rest].tolist()))
    allowed = np.zeros((rest.size, len(kinds)), dtype=bool)
    allowed[:, 0] = True
    is_waiting = rest >= n_run
    # A waiting request that found its prefix cached in one kind is admitted in that kind: in
    # another it would compute the prefix again (each kind caches its own pages), to save few pages.
    # (Where its kind is compressed and the ceiling leaves no room now, KV stays open to it.)
    hit = c.hit_kind[rest] if c.hit_kind is not None else np.full(rest.size, NO_PAGES)
    for j, k in enumerate(kinds[1:], 1):
        allowed[:, j] = (held == k) | ((is_waiting & ((hit < 0) | (hit == k))) if k in offered else False)
    if ctx.compressed_pages_left > 0:
        allowed[:, 0] &= ~(is_waiting & (hit > 0) & np.isin(hit, [k for k in kinds[1:] if k in offered]))
    values = value[rest, None] - kind_weight[rest, None] * d.per_page[kinds][None, :]
    if c.copy is not None:
        price_recompute(d, rest, kinds, values, allowed)
    # The ceiling: what compressed kinds may still take, plus what the rows in the knapsack hold
    # now (they are chosen again), less the growth of the first ones that hold compressed pages.
    # (A compressed copy in the tier counts as held: it was admitted under the ceiling, and comes back
    # under it as a running compressed request grows past it.)
    comp_first = np.flatnonzero(first & c.is_compressed)
    comp_idx = rest[comp_rest]
    limit = (ctx.compressed_pages_left + int(np.where(comp_idx < n_run, c.num_held[comp_idx], c.mem_held[comp_idx]).sum())
             - int((first_mem[comp_first] - c.num_held[comp_first]).sum()))
    choice = greedy_choice(values, c.mem[kinds][:, rest].T, allowed, max(0, capacity),
                           compressed=_COMPRESSED[kinds], compressed_limit=max(0, limit),
                           memory_weight=p.weights.memory_weight)
    chosen = first.copy()
    kind = np.where(first, np.maximum(current, 0), SKIP)
    chosen[rest] = choice.option >= 0
    kind[rest] = np.where(chosen[rest], np.asarray(kinds)[np.maximum(choice.option, 0)], SKIP)
    if reserved >= n_run and capacity < 0:
        # Its pages are not free yet: it waits for them (a chunk started in the pages there are
        # would take the running requests' growth and preempt them), and nobody takes them first.
        chosen[reserved], kind[reserved] = False, SKIP
        reserved = -1
    p.reserved = c.requests[reserved] if reserved >= 0 and p.keep_reservation else None
    density = p.weights.density(value, c.mem_kv)
    forced_idx = np.flatnonzero(forced)
    forced_idx = forced_idx[np.argsort(c.arrival[forced_idx], kind="stable")]
    if reserved >= 0:
        forced_idx = np.append(forced_idx, reserved)  # after the protected, before everyone else
    others = np.flatnonzero(chosen & ~forced)
    others = others[others != reserved]
    order = np.concatenate((forced_idx, others[np.argsort(-density[others], kind="stable")]))
    plan = Plan(value, density, forced, pinned, chosen, kind, order, capacity - choice.pages)
    if (kind[n_run:] > 0).any():
        cap_compressed(d, plan)
    if p.priority_preemption and n > n_run and c.priority is not None:
        preempt_for_priority(d, plan)
    if p.admission_share is not None and p.step_model is not None and n > n_run:
        admit_within_promise(c, plan, reserved, step_model=p.step_model, per_page=d.per_page,
                             admission_share=p.admission_share,
                             target_scale=p.tbt_headroom / p.slowdown / 1000.0)
    d.plan = plan
    return plan


def price_recompute(d: Decision, rest: np.ndarray, kinds: list[int], values: np.ndarray, allowed: np.ndarray) -> None:
    """A waiting request whose tokens wait in the tier comes back in the copy's kind, or converted
    (``can_convert``: quantised to its int8 kind) at no extra cost; any other kind drops the copy and
    recomputes its tokens, which delays the U requests that can still pass (priced as an eviction),
    and at least the request itself: with U = 0 (all late) a free recompute tied with the copy and
    the greedy's zero-value upgrade step threw the copy away whenever the KV pages fitted. Without
    a step-time model to price it, a copy is never thrown away."""
    c, step_model = d.c, d.step_model
    copy = c.copy[rest]
    has_copy = copy >= 0
    if not has_copy.any():
        return
    lost = has_copy[:, None] & ~_COMES_BACK_AS[np.maximum(copy, 0)][:, kinds]
    if step_model is None:
        allowed &= ~lost
        return
    redo_s = max(1, int((~c.missed).sum())) * recompute_seconds(step_model,
                                                              c.num_computed[rest].astype(np.float64))
    values -= np.where(lost, redo_s[:, None], 0.0)


def preempt_for_priority(d: Decision, plan: Plan) -> None:
    """Let a waiting request that does not fit, and can still meet its SLO, take the pages of pinned
    running requests of a lower priority (a larger value), when it is worth more than they are together (their values
    include what evicting them costs: ``price``). Waiting requests in density order; victims of
    the lowest priority first, then the lowest density; never the protected, never one of the same
    or a higher priority (so requests of one class never evict each other: no thrashing). The
    victims become unchosen, the first ones ``shape.run`` evicts for a waiting request."""
    c = d.c
    n_run, prio, value = c.num_running, c.priority, plan.value
    # Only for a request that can still meet its SLO: evicting for those that have already missed
    # too was worse for both classes (LongBench-like, 1.5x: 16% / 40% against 24% / 51%).
    waiting = np.flatnonzero(~plan.chosen[n_run:] & ~c.missed[n_run:]) + n_run
    running = np.flatnonzero(plan.pinned[:n_run] & plan.chosen[:n_run])
    if not waiting.size or not running.size or prio[waiting].min() >= prio[running].max():
        return
    victims = running[np.lexsort((plan.density[running], -prio[running]))].tolist()
    hold_s, back_s = promise_times(d) if d.policy.evict_within_promise else (None, None)
    changed = False
    for i in waiting[np.argsort(-plan.density[waiting], kind="stable")].tolist():
        short = int(c.mem_kv[i]) - plan.spare
        pick, freed, lost = [], 0, 0.0
        for v in victims:
            if short <= freed or prio[v] <= prio[i]:
                break
            if hold_s is not None and not c.missed[v] and c.promise_left_s[v] < hold_s[i] + back_s[v]:
                continue  # it could not be back before its next token is late: a promise it keeps
            pick.append(v)
            freed += int(c.num_held[v]) + 1  # its pages and its page of growth
            lost += value[v]
        if short > freed or (pick and lost >= value[i]):
            continue
        for v in pick:
            victims.remove(v)
            plan.pinned[v] = plan.chosen[v] = False
            plan.kind[v] = SKIP
        plan.chosen[i], plan.kind[i] = True, max(int(c.current[i]), 0)  # KV, or back in its copy's kind
        plan.spare += freed - int(c.mem_kv[i])
        changed = True
    if changed:
        forced_idx = plan.order[plan.forced[plan.order]]
        others = np.flatnonzero(plan.chosen & ~plan.forced)
        plan.order = np.concatenate((forced_idx, others[np.argsort(-plan.density[others], kind="stable")]))


def promise_times(d: Decision) -> tuple[np.ndarray | None, np.ndarray | None]:
    """For priority preemption that keeps the victims' promises (``evict_within_promise``): per waiting
    row, the seconds it would hold the pages it takes (its prompt's prefill, then its outputs up to
    ``max_tokens`` at the step time of today's decodes; its pages free when it finishes), and per running
    row, what its eviction and return cost (out to the tier and back where the tier has room, else its
    tokens computed again). A victim that can still pass is taken only if the sum fits in what is left
    of its TTFT or gap allowance (``promise_left_s``). (None, None) without a step-time model."""
    p, c = d.policy, d.c
    if p.step_model is None or c.promise_left_s is None or c.max_num_tokens is None:
        return None, None
    n_run = c.num_running
    decoding = np.flatnonzero(c.is_decoding[:n_run])
    step_s = (d.decode_seconds(decoding) if decoding.size else float(p.step_model.predict(1, 1))) * p.slowdown
    prompt_left = np.maximum(c.num_tokens - c.num_computed, 0).astype(np.float64)
    outputs = np.maximum(c.max_num_tokens - c.num_tokens, 1).astype(np.float64)
    hold_s = recompute_seconds(p.step_model, prompt_left) * p.slowdown + outputs * step_s
    return hold_s, eviction_seconds(d) * p.slowdown


def protected_rows(d: Decision) -> np.ndarray:
    """Rows protected from starvation: waited ``max_wait_time`` once, protected until finished (the
    policy's ``protected`` set, kept across decisions, is updated here)."""
    p, ctx, c = d.policy, d.ctx, d.c
    if p.protected:
        p.protected &= set(c.requests) | set(ctx.running)
    overdue = np.flatnonzero(c.pending_s > p.max_wait_time)
    p.protected.update(c.requests[i] for i in overdue)
    if not p.protected:
        return np.zeros(c.num, dtype=bool)
    return np.fromiter(map(p.protected.__contains__, c.requests), dtype=bool, count=c.num)


def cap_compressed(d: Decision, plan: Plan) -> None:
    """Admit a waiting request in a compressed kind only where it keeps the step under the TBT target.

    A compressed request lengthens every later step (recompute for the hidden kinds, dequantisation
    for the int8 ones), for every request in the batch, while it holds the kind. The knapsack prices
    that as ``U * c_k * m``, which is 0 when U is 0 (under overload every running request may have
    missed): then every waiting request went hidden, the steps grew by ``rho * m`` each, and the
    server could not recover (measured through Ray Serve on OPT-125m / CPU: 82% of the replica's
    time in the K/V projection and attainment falling to 28% at a load vLLM held at 100%). So, in
    the order of choice, a waiting request keeps its compressed kind only while the predicted decode
    step with every compressed kind's extra time stays under ``tbt_headroom`` x the tightest TBT
    target among the running and the chosen; otherwise it takes KV pages if the spare pages allow,
    or waits (dropped from the plan). (Where a kind cannot raise throughput at all, the knapsack is
    not offered it: ``kind_pays_for_throughput``.)
    """
    p, c = d.policy, d.c
    if p.step_model is None or not d.per_page.any():
        return
    order, kind, need = plan.order, plan.kind, c.need
    target = p.tbt_headroom * float(c.tbt_slo_ms[order].min()) / 1000.0
    decodes = c.is_decoding
    base = p.step_model.predict(int(decodes.sum()), int(need[decodes].sum()),
                                   int(need[decodes & c.is_hidden].sum()))
    base += d.held_extra_s(np.flatnonzero(decodes))
    headroom, spare, dropped = target - base, plan.spare, []
    for i in order[(order >= c.num_running) & (kind[order] > 0)].tolist():
        k = kind[i]
        cost = d.per_page[k] * c.mem_kv[i]
        extra = c.mem_kv[i] - c.mem[k, i]
        if cost <= headroom:
            headroom -= cost
        elif spare >= extra:
            spare -= extra
            kind[i] = 0
        else:
            kind[i] = SKIP
            dropped.append(i)
    plan.spare = spare
    if dropped:
        plan.chosen[dropped] = False
        plan.order = order[plan.chosen[order]]
