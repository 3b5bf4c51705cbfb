"""The adaptive SLO-aware policy (Apt-Serve, SPEC section 2), with three measured corrections.

Every step, over one table of candidates (``Candidates``: running requests not yet scheduled, then
admissible waiting ones), in four stages:

1. **Price** (``_price``). The value model (``scheduler/value.py``) with the operator's weights. A
   request that has already missed its SLO (late first token, or a gap over its TBT target) no longer
   counts for attainment: it keeps ``fairness_penalty`` of its value, and ``U`` counts the others.
   Choosing the hidden kind costs ``U * rho * m`` (rho: seconds to recompute one page of K/V per step,
   m: its pages with a full KV cache), the paper's price. Evicting a running request throws its
   computed tokens away, priced the same way (U x their recompute time).
2. **Choose** (``_choose``). Running requests that can still pass keep their memory (first
   correction: the paper's value, pending time, is near zero for a request that just got a token,
   so the greedy evicted running requests on every step; each eviction is a recompute and a missed
   TBT target, and that thrashing lost to FCFS on the simulator and on the engine). They are pinned;
   the knapsack (``knapsack.greedy_select``, the 2-approximation) chooses, under the remaining pages,
   among waiting requests and running ones that have already missed, which hold memory and in which
   kind. As U * rho * m vanishes when U does, the hidden kind is also capped by step time (third
   correction, ``_cap_hidden``): the predicted decode step with all hidden recompute must stay under
   the tightest TBT target.
3. **Admit, preempt, upgrade** (``_set_kinds``, ``_run``). Chosen waiting requests are admitted with
   their kind; unchosen running ones are preempted only when their pages are needed; running hidden
   requests chosen as KV are upgraded in place, and pinned hidden ones go back to KV while pages allow.
4. **Shape the iteration** (``_shape``). Prefill chunks get as many tokens as keep the predicted step
   under the tightest TBT target of the running requests that can still pass (second correction,
   Sarathi's lesson made SLO-aware); if the summed pending time of the waiting exceeds that of the
   running, prefills are placed first, otherwise decodes (the paper).

**No starvation.** A request that has waited ``max_wait_time`` is protected until it finishes: served
first, oldest first, outside the knapsack, never a victim. Running KV requests are never switched to
hidden: x is gone, it would be a preemption with recompute. Measured on the simulator
(``tests/test_priority.py``): under priority-0 load at 1.25x capacity, requests at priority 100 (200 s
ahead by the default weights) started at 60.0-60.1 s, ``max_wait_time`` + one step; at priority 10
(20 s ahead) the time term alone let them in after 21-22 s. The bound holds while the protected are
fewer than the engine serves; where the backlog older than ``max_wait_time`` keeps growing, they
are served first-come-first-served and every wait grows with it.

The costs (rho, the step-time model) are injected (``set_costs``), measured by the engine at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apt_serve_ray.request import CacheKind, RequestStatus
from apt_serve_ray.scheduler.candidates import Candidates, WaitingRows
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.knapsack import greedy_select
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy, run_running
from apt_serve_ray.scheduler.registry import register_policy
from apt_serve_ray.scheduler.value import FAIRNESS_PENALTY, MAX_WAIT_S, ValueWeights


@dataclass
class _Plan:
    """What ``_choose`` decided, per candidate row."""

    value: np.ndarray
    density: np.ndarray
    forced: np.ndarray  # protected: first, oldest first, never a victim
    pinned: np.ndarray  # running requests that keep their memory and kind
    chosen: np.ndarray
    hidden: np.ndarray  # chosen with the hidden kind
    order: np.ndarray  # chosen rows: the forced by arrival, then by density
    spare: int  # pages left after the chosen and one page of growth per running request


@register_policy
class AdaptiveScheduler(SchedulingPolicy):
    name = "apt"

    def __init__(
        self, time_weight: float = ValueWeights.time_weight, memory_weight: float = ValueWeights.memory_weight,
        slo_weight: float = ValueWeights.slo_weight, priority_weight: float = ValueWeights.priority_weight,
        fairness_penalty: float = FAIRNESS_PENALTY, max_wait_time: float = MAX_WAIT_S,
        *, config=None, rho: float | None = None, step_model=None, tbt_headroom: float = 0.8,
        hidden_cost_steps: float = 8.0, evict_missed: bool = False,
    ) -> None:
        super().__init__(config)
        self.weights = ValueWeights(time_weight, memory_weight, slo_weight, priority_weight)
        if not 0.0 < fairness_penalty <= 1.0:
            raise ValueError(f"fairness_penalty: must be in (0, 1], got {fairness_penalty!r}")
        if not max_wait_time > 0:
            raise ValueError(f"max_wait_time: must be > 0 seconds, got {max_wait_time!r}")
        if not hidden_cost_steps >= 1.0:
            raise ValueError(f"hidden_cost_steps: must be >= 1, got {hidden_cost_steps!r}")
        if not 0.0 < tbt_headroom <= 1.0:
            raise ValueError(f"tbt_headroom: must be in (0, 1], got {tbt_headroom!r}")
        self.fairness_penalty, self.max_wait_time = float(fairness_penalty), float(max_wait_time)
        # Given costs win; the engine measures the ones left None and injects them (``set_costs``).
        self.costs = StepCosts(rho, step_model)
        self.tbt_headroom = tbt_headroom
        # The paper prices the hidden kind for one step (U * rho * m); a request stays hidden until
        # memory allows its upgrade, so the operator may price more steps where recompute is dear.
        self.hidden_cost_steps = float(hidden_cost_steps)
        # Whether running requests that already missed their SLO compete for memory with waiting ones
        # (and may be evicted for them), as in the paper; off, they keep running and are only the
        # first victims when a running request needs pages to grow.
        self.evict_missed = bool(evict_missed)
        self._protected: set = set()  # Request objects
        self._waiting_rows = WaitingRows()

    @property
    def rho(self) -> float:
        return self.costs.rho or 0.0

    @property
    def step_model(self):
        return self.costs.step_time

    # ----------------------------------------------------------------------------------------------
    def schedule(self, ctx) -> None:
        w = self.weights
        cands = Candidates.gather(ctx, self._waiting_rows, with_urgency=bool(w.slo_weight),
                                  with_importance=bool(w.priority_weight))
        if cands is None:
            return
        value, recompute_cost = self._price(cands)
        plan = self._choose(ctx, cands, value, recompute_cost)
        self._set_kinds(ctx, cands, plan)
        self._shape(ctx, cands, plan)

    def _price(self, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's value, and what choosing the hidden kind for it would cost."""
        value = self.weights.value(c.pending_s, c.urgency, c.importance, missed=c.missed,
                                   fairness_penalty=self.fairness_penalty)
        u = int((~c.missed).sum())
        recompute_cost = u * self.rho * c.mem_kv * self.hidden_cost_steps
        if c.num_running and self.step_model is not None:
            # Evicting a running request throws its computed tokens away: recomputing them delays
            # the U requests that can still pass, priced like the hidden kind's recompute (U x time).
            value[:c.num_running] += u * self._prefill_token_s() * c.num_computed[:c.num_running].astype(np.float64)
        return value, recompute_cost

    def _choose(self, ctx, c: Candidates, value: np.ndarray, recompute_cost: np.ndarray) -> _Plan:
        n, n_run = c.num, c.num_running
        forced = self._forced(ctx, c)
        pinned = np.zeros(n, dtype=bool)
        pinned[:n_run] = ~forced[:n_run] & (~c.missed[:n_run] if self.evict_missed else True)
        # Memory the pinned and forced take first, in their current kind (KV for new forced ones).
        first = forced | pinned
        first_mem = np.where(c.is_hidden, c.mem_hidden, c.mem_kv)
        # One page of growth is reserved per running request, so admissions do not force memory
        # preemptions a few steps later (measured: 47 -> 14 preemptions, ShareGPT 4 req/s, simulated).
        capacity = ctx.num_free_pages + int(c.num_held[:n_run].sum()) - int(first_mem[first].sum()) - n_run
        hidden_ok = np.zeros(n, dtype=bool)
        if ctx.hidden_allowed:
            hidden_ok[:n_run] = c.is_hidden[:n_run]
            # New requests get the hidden kind only where it can raise throughput (see the method).
            hidden_ok[n_run:] = self.hidden_pays_for_throughput(ctx.cache.pool.num_pages,
                                                                ctx.cache.layout.hidden_ratio)
        rest = np.flatnonzero(~first)
        sel = greedy_select(value[rest], recompute_cost[rest], c.mem_kv[rest], c.mem_hidden[rest], hidden_ok[rest],
                            max(0, capacity), memory_weight=self.weights.memory_weight)
        chosen, hidden = first.copy(), c.is_hidden & first
        chosen[rest], hidden[rest] = sel.chosen, sel.hidden
        density = self.weights.density(value, c.mem_kv)
        forced_idx = np.flatnonzero(forced)
        forced_idx = forced_idx[np.argsort(c.arrival[forced_idx], kind="stable")]
        others = np.flatnonzero(chosen & ~forced)
        order = np.concatenate((forced_idx, others[np.argsort(-density[others], kind="stable")]))
        plan = _Plan(value, density, forced, pinned, chosen, hidden, order, capacity - sel.pages)
        if hidden[n_run:].any():
            self._cap_hidden(c, plan)
        return plan

    def _forced(self, ctx, c: Candidates) -> np.ndarray:
        """Rows protected from starvation: waited ``max_wait_time`` once, protected until finished."""
        if self._protected:
            self._protected &= set(c.requests) | set(ctx.running)
        overdue = np.flatnonzero(c.pending_s > self.max_wait_time)
        self._protected.update(c.requests[i] for i in overdue)
        if not self._protected:
            return np.zeros(c.num, dtype=bool)
        return np.fromiter(map(self._protected.__contains__, c.requests), dtype=bool, count=c.num)

    def hidden_pays_for_throughput(self, num_pages: int, hidden_ratio: float) -> bool:
        """Whether filling memory with hidden requests raises decode throughput at all.

        With the pool full, N requests of which x are hidden (page share ``h`` of KV): every request
        beyond the KV capacity K needs ``1 / (1 - h)`` conversions to hidden, so the step is
        ``T(N) = a + beta N + r L (N - K) / (1 - h)`` (a: the fixed step cost, beta: per request,
        r: the hidden kind's extra seconds per context token, L: context per request). Tokens per
        second N / T(N) grow with N exactly when ``a > r * K * L / (1 - h)``, whatever N is: the
        fixed cost a step amortises must exceed the recompute of the KV capacity's worth of tokens
        held hidden. On a GPU decode is memory-bound and ``a`` (reading the weights) dominates; on a
        CPU the recompute usually does (measured, OPT-125m on 2 cores: a = 3-4 ms, r = 2 us/token,
        6,048-token pool: 25 ms), and a pool full of hidden requests ran 0.65x KV's tokens per second.
        With ``num_pages`` KV pages, ``r * K * L`` is ``rho * num_pages`` (rho: seconds per page).
        """
        if self.step_model is None or not self.rho:
            return True
        fixed = self.step_model.predict(1, 1)
        return fixed > self.rho * num_pages / max(1e-9, 1.0 - hidden_ratio)

    def _cap_hidden(self, c: Candidates, plan: _Plan) -> None:
        """Admit a waiting request as hidden only where it keeps the step under the TBT target.

        Recomputing K/V for a hidden request lengthens every later step, for every request in the
        batch, while it stays hidden. The knapsack prices that as ``U * rho * m``, which is 0 when U
        is 0 (under overload every running request may have missed): then every waiting request went
        hidden, the steps grew by ``rho * m`` each, and the server could not recover (measured through
        Ray Serve on OPT-125m / CPU: 82% of the replica's time in the K/V projection and attainment
        falling to 28% at a load vLLM held at 100%). So, in the order of choice, a waiting request
        keeps the hidden kind only while the predicted decode step with all hidden recompute stays
        under ``tbt_headroom`` x the tightest TBT target among the running and the chosen; otherwise
        it takes KV pages if the spare pages allow, or waits (dropped from the plan).
        (Where the hidden kind cannot raise throughput at all, the knapsack is not offered it:
        ``hidden_pays_for_throughput``.)
        """
        per_page = self.rho
        if self.step_model is None or not per_page:
            return
        order, hidden, need = plan.order, plan.hidden, c.need
        target = self.tbt_headroom * float(c.tbt_slo_ms[order].min()) / 1000.0
        decodes = c.is_decoding
        base = self.step_model.predict(int(decodes.sum()), int(need[decodes].sum()),
                                       int(need[decodes & c.is_hidden].sum()))
        headroom, spare, dropped = target - base, plan.spare, []
        for i in order[(order >= c.num_running) & hidden[order]].tolist():
            cost = per_page * c.mem_kv[i]
            if cost <= headroom:
                headroom -= cost
            elif spare >= c.mem_kv[i] - c.mem_hidden[i]:
                spare -= c.mem_kv[i] - c.mem_hidden[i]
                hidden[i] = False
            else:
                hidden[i] = False
                dropped.append(i)
        plan.spare = spare
        if dropped:
            plan.chosen[dropped] = False
            plan.order = order[plan.chosen[order]]

    def _set_kinds(self, ctx, c: Candidates, plan: _Plan) -> None:
        """Upgrades in place: running hidden requests the knapsack wants as KV, then (hidden is a remedy
        for memory pressure, not a state) pinned hidden ones while the spare pages allow, largest
        context first (it costs the most per step)."""
        order, hidden, first = plan.order, plan.hidden, plan.forced | plan.pinned
        rows = order[order < c.num_running]
        for i in rows[c.is_hidden[rows] & ~hidden[rows] & ~first[rows]].tolist():
            ctx.upgrade(c.requests[i])
        back = np.flatnonzero(plan.pinned & c.is_hidden)
        for i in back[np.argsort(-c.need[back], kind="stable")].tolist():
            if plan.spare >= c.mem_kv[i] and ctx.upgrade(c.requests[i]):
                plan.spare -= c.mem_kv[i] - c.mem_hidden[i]
                hidden[i] = False

    def _shape(self, ctx, c: Candidates, plan: _Plan) -> None:
        """Run the chosen: decodes and prefills in the paper's order, prefills under the step-time budget."""
        n_run, order = c.num_running, plan.order
        is_decode = c.is_decoding[order]
        decodes, prefills = order[is_decode].tolist(), order[~is_decode].tolist()
        # Victims when pages run short: unchosen first, then (only for running requests' growth) those
        # that already missed, then the rest; lowest density first; never the protected.
        running = np.flatnonzero(~plan.forced[:n_run])
        victims = running[np.lexsort((plan.density[running], ~c.missed[running], plan.chosen[running]))].tolist()
        unchosen = np.flatnonzero(~plan.chosen[:n_run]).tolist()
        evictable = set(unchosen)
        prefill_budget = self._prefill_budget(ctx, c, decodes)
        if c.pending_s[n_run:].sum() > c.pending_s[:n_run].sum():
            self._run(ctx, c, plan.hidden, prefills, prefill_budget, victims, evictable)
            self._run(ctx, c, plan.hidden, decodes, ctx.token_budget, victims, evictable)
        else:
            self._run(ctx, c, plan.hidden, decodes, ctx.token_budget, victims, evictable)
            self._run(ctx, c, plan.hidden, prefills, prefill_budget, victims, evictable)
        # Unchosen running requests still holding pages keep decoding while the budget lasts.
        self._run(ctx, c, plan.hidden, unchosen, ctx.token_budget, [], set())
        if ctx.num_scheduled == 0 and ctx.running:
            # Liveness: page estimates can be off by rounding; never let a step schedule nothing
            # while requests hold memory. Fall back to preempting the lowest-value running request.
            rank = {id(c.requests[i]): plan.density[i] for i in range(n_run)}
            key = lambda r: (r not in self._protected, -rank.get(id(r), 0.0))  # noqa: E731
            run_running(ctx, sorted(ctx.running, key=key), victim_key=key, chunked=True)

    def _prefill_token_s(self) -> float:
        return max(self.step_model.predict(1, 1) - self.step_model.predict(0, 0), 1e-9)

    def _prefill_budget(self, ctx, c: Candidates, decodes: list[int]) -> int:
        """Prefill tokens that keep the step under the tightest TBT target of the decodes that can still
        pass (at least one page's worth, so prefills always progress)."""
        budget = ctx.token_budget
        if self.step_model is None:
            return budget
        live = [i for i in decodes if not c.missed[i]]
        if not live:
            return budget
        target = self.tbt_headroom * float(c.tbt_slo_ms[live].min()) / 1000.0
        ctx_tokens = c.num_tokens[decodes]
        base = self.step_model.predict(len(decodes), int(ctx_tokens.sum()),
                                       int(ctx_tokens[c.is_hidden[decodes]].sum()))
        room = int((target - base) / self._prefill_token_s())
        # Leave one token per decode: prefill-first steps must not make every decode skip the step.
        return max(1, min(max(ctx.cache.layout.block_size, min(budget, room)), budget - len(decodes)))

    def _run(self, ctx, c: Candidates, hidden: np.ndarray, rows: list[int], budget: int, victims: list[int],
             evictable: set[int]) -> None:
        """Schedule ``rows`` in order while ``budget`` tokens last; when pages are short, preempt
        ``victims`` in order (for a waiting request, only the ``evictable`` ones)."""
        requests, n_run = c.requests, c.num_running
        for i in rows:
            if budget <= 0 or ctx.num_seqs_left <= 0:
                return  # neither comes back within this loop: nothing later could run
            r = requests[i]
            if r.is_finished or ctx.is_scheduled(r):
                continue
            if r.status is RequestStatus.WAITING and (i < n_run or not ctx.can_admit(r)):
                continue  # preempted during this decision, or admission closed
            n = min(r.num_tokens_to_compute, budget, ctx.token_budget)
            if n <= 0:
                continue
            kind = None
            if r.kind is None:
                kind = CacheKind.HIDDEN if hidden[i] and ctx.hidden_allowed else CacheKind.KV
            while not ctx.schedule(r, n, kind):
                victim = self._next_victim(requests, victims, r, None if i < n_run else evictable)
                if victim is None or ctx.cache.can_allocate(r, r.num_computed_tokens + n, kind):
                    break
                victims.remove(victim)
                ctx.preempt(requests[victim], cause="policy" if i >= n_run else "memory")
            else:
                budget -= n

    @staticmethod
    def _next_victim(requests, victims: list[int], r, evictable: set[int] | None) -> int | None:
        """The first running victim other than ``r`` (among ``evictable`` only, unless None). The
        evictable ones, the unchosen, lead the list (``_shape`` sorts them first), so the search for a
        waiting request stops where they end: scanning every victim for every waiting request that
        does not fit was quadratic (0.9 s of a 6,400-candidate decision)."""
        for v in victims:
            if evictable is not None and v not in evictable:
                return None
            if requests[v].status is RequestStatus.RUNNING and requests[v] is not r:
                return v
        return None
