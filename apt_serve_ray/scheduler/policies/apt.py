"""The adaptive SLO-aware policy (Apt-Serve, SPEC section 2), with three measured corrections.

Every step, over one table of candidates (``Candidates``: running requests not yet scheduled, then
admissible waiting ones), in four stages:

1. **Price** (``_price``). The value model (``scheduler/value.py``) with the operator's weights. A
   request that has already missed its SLO (late first token, or a gap over its TBT target) no longer
   counts for attainment: it keeps ``fairness_penalty`` of its value, and ``U`` counts the others.
   Every compressed kind k the engine offers now (``ctx.compressed_kinds``: none at ``cache_ratio`` 0)
   is one more option per request, worth ``v - U * c_k * m * hidden_cost_steps`` (c_k: the measured
   decode-step seconds per KV page's worth of context held in k, ``StepCosts``; rho for the hidden
   kind, the paper's price). m is the request's pages *with a full KV cache* for every kind, not its
   pages in k: what a compressed kind adds to a step grows with the context it holds (tokens to
   recompute or dequantise), and c_k is measured per KV page of context, so one m keeps every kind on
   the same scale; the kind's own pages are what it saves, on the knapsack's other axis. Evicting a
   running request throws its computed tokens away, priced the same way (U x their recompute time).
2. **Choose** (``_choose``). Running requests that can still pass keep their memory (first
   correction: the paper's value, pending time, is near zero for a request that just got a token,
   so the greedy evicted running requests on every step; each eviction is a recompute and a missed
   TBT target, and that thrashing lost to FCFS on the simulator and on the engine). They are pinned,
   in the kind they hold; the multiple-choice knapsack (``knapsack.greedy_choice``) chooses, under the
   remaining pages and under the compressed pages ``cache_ratio`` still allows
   (``ctx.compressed_pages_left``, less the growth of the pinned compressed ones), among waiting
   requests and running ones that have already missed, which hold memory and in which kind (at most
   one each; a running one may keep its kind or go to KV). ``cache_ratio`` is so a ceiling on what
   admission chooses: a request already running in a compressed kind still grows past it by its next
   pages. As U * c_k * m vanishes when U does, compressed kinds are also capped by step time (third
   correction, ``_cap_compressed``): the predicted decode step with every compressed kind's extra
   time must stay under the tightest TBT target. A kind is offered to new requests only where it can
   raise throughput at all (``kind_pays_for_throughput``) and the runner could run it at calibration.
3. **Change kinds in place, admit, preempt** (``apt_kinds.py``, ``_run``). When memory alone keeps the
   most valuable waiting request out, pinned running requests are compressed in place to an offered
   int8 kind (fourth correction: pinning left an arrival outside a full pool of KV requests until one
   finished; simulated ShareGPT-like, all kinds at ceiling 1.0: attainment at 3 req/s 50% -> 92%,
   effective throughput at 90% 1.55 -> 3.0 req/s, the top rate of the sweep). Chosen waiting requests are admitted with their kind (a swapped one in its copy's
   kind, converted to int8 on the way in, or recomputed where that is priced cheaper); unchosen
   running ones are preempted only when their pages are needed; running requests of a compressed
   kind chosen as KV are upgraded in place, and pinned ones go back to KV while pages allow and
   nobody waits.
4. **Shape the iteration** (``apt_iteration.py``). A step is a promise to every decoding request that
   can still pass (second correction, Sarathi's lesson made SLO-aware; issue 26): its budget
   (``StepBudget``) is ``tbt_headroom`` x the tightest TBT target among them, where "can still pass" is
   the P99 of the request's gaps, not its longest gap (``gap_budget``: one long gap among many may be
   forgiven, and a request written off at its first long gap stopped bounding the steps, which then
   took the whole token budget and broke every other request's gaps in turn). Decode rows, in-place
   kind changes and swap-ins spend from the budget first (a change the step cannot afford waits for a
   later step); then each prefill chunk, in the plan's order, gets the most tokens whose predicted
   time (with its query-key pairs: a chunk deep in a long prompt costs more) fits what is left, so long
   prompts are split across steps while tight requests run. Predictions are scaled by how much longer
   than predicted steps have lately run (``observe_step``). The paper alternates prefill and decode
   iterations by summed pending time; with chunked prefill both share every step, decodes first.
   What this changed on that traffic, per step and per request: docs/benchmarks.md (issue 26).

**Admission as a promise** (issue 44; ``apt_admission.py``). Stage 4 bounds each step,
but the greedy still started every waiting request memory allowed: under a burst the decode rows alone
then outgrew the tightest gap (a burstier variant of issue 26's traffic, 2 req/s: 23 of 29 chats broke
their 0.5 s gap, none was late). So a chosen waiting request keeps its place only while the predicted
decode step with it, and with every running request, each at the context it will hold when it finishes
(at most ``PROMISE_LOOKAHEAD`` tokens ahead), stays within ``admission_share`` of the step's target;
those that can still pass are admitted before the late ones, the rest wait (a request kept waiting
still has its TTFT; one started and then stalled has lost). And since the greedy weighs value per page,
short requests were admitted ahead of a long, older one until its TTFT was lost (documents behind
chats): the oldest waiting request that can still pass and has used ``reserve_after`` of its TTFT
target has its pages taken out of what the greedy shares, and leads the admissions; one at a time.
And a request that cannot have its first token in time even if served in the order the policy serves
(the more important first, then the nearest deadline), at the rate prefill runs beside the decodes now,
is written off before its deadline as one already late (``predicted_late``, ``write_off_late``): under
a burst of documents each one otherwise ran a little late in turn, and took the turn of those behind it.

**Priority overtakes** (``priority_preemption``, issue 16). Pinning alone kept an important request
that arrived to a full pool waiting behind unimportant running ones until they finished (interactive
class, 30% of a ShareGPT-like mix at 1.5x capacity: longest wait 64 s). So a waiting request that
does not fit may take the pages of pinned running requests of a lower priority (a larger value) when
it is worth more than they are together, evicting them (``_preempt_for_priority``); and when a running
request needs pages to grow, the least important go first (``apt_iteration``). Eviction is priced as
what it costs: a swap out and back where the tier below memory has room, else a recompute. Measured
(``benchmarks/priority_classes.py``, simulator, 4 GiB tier): interactive / batch attainment at 1x,
1.5x, 2x capacity 0.91 / 0.92, 0.73 / 0.80, 0.64 / 0.70 (without: 0.64 / 0.96, 0.56 / 0.85, 0.56 /
0.83); longest interactive wait 2-21 s (was 46-65 s). Without the tier, evictions are recomputes and
the batch class pays more (0.75, 0.57, 0.60 batch attainment).

**No starvation.** A request that has waited ``max_wait_time`` is protected until it finishes: served
first, oldest first, outside the knapsack, never a victim. Running KV requests are never switched to
hidden: x is gone, it would be a preemption with recompute. Measured on the simulator
(``tests/scheduler/test_priority.py``): under priority-0 load at 1.25x capacity, requests at priority 100 (200 s
ahead by the default weights) started at 60.0-60.1 s, ``max_wait_time`` + one step; at priority 10
(20 s ahead) the time term alone let them in after 21-22 s. The bound holds while the protected are
fewer than the engine serves; where the backlog older than ``max_wait_time`` keeps growing, they
are served first-come-first-served and every wait grows with it.

The costs (rho and the other kinds' costs, the step-time model) are injected (``set_costs``),
measured by the engine at start.
"""

from __future__ import annotations

import numpy as np

from apt_serve_ray.cache.cache_manager import can_convert
from apt_serve_ray.scheduler.candidates import KIND_CODE, KINDS, NEVER_FITS, NO_PAGES, Candidates, WaitingRows
from apt_serve_ray.scheduler.costs import StepCosts, recompute_seconds
from apt_serve_ray.scheduler.knapsack import SKIP, greedy_choice
from apt_serve_ray.scheduler.policies.apt_admission import (admit_within_promise, int8_seconds, predicted_late,
                                                            reserved_row)
from apt_serve_ray.scheduler.policies.apt_iteration import IterationShaper, Plan
from apt_serve_ray.scheduler.policies.apt_kinds import KindChanger
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy
from apt_serve_ray.scheduler.registry import register_policy
from apt_serve_ray.scheduler.value import FAIRNESS_PENALTY, MAX_WAIT_S, ValueWeights


_COMPRESSED = np.array([k.is_compressed for k in KINDS])
# [copy's kind, kind] -> whether a copy in the tier comes back in that kind without a recompute.
_COMES_BACK_AS = np.array([[can_convert(a, b) for b in KINDS] for a in KINDS])


@register_policy
class AdaptiveScheduler(KindChanger, IterationShaper, SchedulingPolicy):
    name = "apt"

    def __init__(
        self, time_weight: float = ValueWeights.time_weight, memory_weight: float = ValueWeights.memory_weight,
        slo_weight: float = ValueWeights.slo_weight, priority_weight: float = ValueWeights.priority_weight,
        fairness_penalty: float = FAIRNESS_PENALTY, max_wait_time: float = MAX_WAIT_S,
        *, config=None, rho: float | None = None, step_model=None, tbt_headroom: float = 0.8,
        hidden_cost_steps: float = 8.0, evict_missed: bool = False, priority_preemption: bool = True,
        admission_share: float | None = 0.8, reserve_after: float | None = 0.5, write_off_late: bool = True,
        shed_late: bool = False,
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
        if admission_share is not None and not 0.0 < admission_share <= 1.0:
            raise ValueError(f"admission_share: must be in (0, 1] or None, got {admission_share!r}")
        if reserve_after is not None and not 0.0 <= reserve_after < 1.0:
            raise ValueError(f"reserve_after: must be in [0, 1) or None, got {reserve_after!r}")
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
        # Whether running requests of a lower priority (a larger value) than a waiting one give up
        # their pin: they compete for memory in the knapsack, priced with what evicting them costs
        # (a swap out and back where the tier has room, else recomputing their tokens), so an
        # important request is not stuck behind pinned unimportant ones (issue 16).
        self.priority_preemption = bool(priority_preemption)
        # Admission as a promise (issue 44): a waiting request starts only while the decode step with it
        # (and everyone before it) stays within ``admission_share`` of the step's time target (the
        # rest is left to prefill chunks); None: admit whatever memory allows, as before.
        self.admission_share = admission_share
        # No class starves: the oldest waiting request that can still pass, once it has waited
        # ``reserve_after`` of its TTFT target, has its pages reserved (nobody is admitted into them
        # ahead of it) and starts first; one at a time. None: off.
        self.reserve_after = reserve_after
        # Lost before they start (issue 44): a waiting request whose first token the step-time model
        # says cannot come in time, even in deadline order, is written off as one already late.
        self.write_off_late = bool(write_off_late)
        # Where the deployment sheds (off by default): such a request that holds nothing yet is turned
        # away at once (503 + Retry-After through the server) instead of running late, behind the rest.
        self.shed_late = bool(shed_late)
        self._protected: set = set()  # Request objects
        self._waiting_rows = WaitingRows()
        self._per_page = np.zeros(len(KINDS))  # each kind's seconds per page, read from the costs per decision
        self._cache, self._free_swap_slots = None, 0  # read per decision: the cache and its tier's room
        self.predictor = None  # a TrafficPredictor (``enable_prediction``); the engine feeds it arrivals
        self.slowdown = 1.0  # measured / predicted step seconds lately (``observe_step``)
        self.sampling_costs = (0.0, 0.0)  # seconds a structured-output row, a penalised row (``observe_sampling``)

    def enable_prediction(self, predictor) -> None:
        """Attach a ``TrafficPredictor`` (the seed's ``scheduler.enable_prediction(predictor)``): the
        engine running this policy feeds it every arrival (``LLMEngine.add_request``), so its forecast
        (``predictor.forecast(horizon_s)``) follows this engine's traffic. The value model does not
        read it yet: a hook for reserving pages for expected arrivals, left until measured to help."""
        self.predictor = predictor

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
        self._per_page = np.array([self.costs.seconds_per_page(k) for k in KINDS])  # KV: 0
        self._cache, self._free_swap_slots = ctx.cache, ctx.num_free_swap_slots
        if self.write_off_late and self.step_model is not None:
            # The reserved request (if any) leads the deadline order, as it leads the admissions.
            lead = reserved_row(cands, np.zeros(cands.num, dtype=bool), self.reserve_after)
            late = predicted_late(cands, self.step_model, seconds_scale=self._prefill_scale(cands),
                                  chunk_tokens=ctx.config.max_num_batched_tokens, lead=lead)
            cands.missed[late] = True
            if self.shed_late:
                self._shed(ctx, cands, late)
        value, kind_weight = self._price(cands)
        offered = self.offered_kinds(ctx)
        plan = self._choose(ctx, cands, value, kind_weight, offered)
        plan.budget = self._step_budget(cands)
        self._compress_for_waiting(ctx, cands, plan, offered)
        self._set_kinds(ctx, cands, plan)
        self._shape(ctx, cands, plan)

    def offered_kinds(self, ctx) -> list[int]:
        """Indices in KINDS of the compressed kinds new requests may get now: those the engine offers
        under ``cache_ratio``, the runner could run at calibration, and that can raise throughput."""
        kinds, unavailable = ctx.compressed_kinds, self.costs.unavailable
        if not kinds:
            return []
        pool_pages, layout = ctx.cache.pool.num_pages, ctx.cache.layout
        return [KIND_CODE[k] for k in kinds if k not in unavailable and self.kind_pays_for_throughput(
            pool_pages, layout.block_size / max(1, layout.tokens_per_page(k)), self.costs.seconds_per_page(k))]

    def _shed(self, ctx, c: Candidates, late: np.ndarray) -> None:
        """Turn away the waiting requests among ``late`` that hold nothing (``ctx.shed``); their rows
        stay in the table, fitting in no kind, so nothing below chooses them."""
        rows = late[(late >= c.num_running) & (c.num_computed[late] == 0)]
        if c.copy is not None:
            rows = rows[c.copy[rows] < 0]
        for row in rows.tolist():
            ctx.shed(c.requests[row])
        c.mem[:, rows] = NEVER_FITS
        c.mem_held[rows] = NEVER_FITS

    def _prefill_scale(self, c: Candidates) -> float:
        """Wall seconds one second of the model's prefill takes now: the measured slowdown, over the
        share of a step the decodes leave (steps are as long as the tightest live gap allows; taken
        as at least a tenth, so a step full of decodes still reads as slow prefill, not none)."""
        rows = np.flatnonzero(c.is_decoding[: c.num_running])
        target = self._step_target(c, rows)
        if target is None:
            return self.slowdown
        context = c.num_computed[rows] + 1
        decode_s = self.step_model.predict(int(rows.size), int(context.sum()),
                                           int(context[c.is_hidden[rows]].sum())) * self.slowdown
        return self.slowdown / min(1.0, max(0.1, 1.0 - decode_s / target))

    def _price(self, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's value, and ``U * m * hidden_cost_steps``: times a kind's seconds per page, what
        choosing that kind for it costs (its value in kind k is ``value - self._per_page[k] * that``)."""
        value = self.weights.value(c.pending_s, c.urgency, c.importance, missed=c.missed,
                                   fairness_penalty=self.fairness_penalty)
        u = int((~c.missed).sum())
        if c.num_running and self.step_model is not None:
            # Evicting a running request delays the U requests that can still pass by what it costs:
            # recomputing its tokens, or moving its pages out and back where the tier below memory
            # has room (and that is cheaper), priced like the hidden kind's recompute (U x time).
            n_run = c.num_running
            evict_s = recompute_seconds(self.step_model, c.num_computed[:n_run].astype(np.float64))
            transfer = getattr(getattr(self._cache, "swap", None), "transfer", None)
            if transfer is not None and self._free_swap_slots:
                swap_s = c.num_held[:n_run] * transfer.seconds(1)  # linear in pages: one product, not a loop
                evict_s = np.where(c.num_held[:n_run] <= self._free_swap_slots, np.minimum(evict_s, swap_s), evict_s)
            value[:n_run] += u * evict_s
        return value, (u * self.hidden_cost_steps) * c.mem_kv

    def _choose(self, ctx, c: Candidates, value: np.ndarray, kind_weight: np.ndarray, offered: list[int]) -> Plan:
        n, n_run = c.num, c.num_running
        forced = self._forced(ctx, c)
        pinned = np.zeros(n, dtype=bool)
        pinned[:n_run] = ~forced[:n_run] & (~c.missed[:n_run] if self.evict_missed else True)
        # Memory the pinned and forced take first, in their current kind (KV for new forced ones).
        reserved = reserved_row(c, forced, self.reserve_after)
        first = forced | pinned
        if reserved >= 0:
            first[reserved] = True
        first_mem = c.mem_held
        current = c.current  # waiting requests with a copy in the tier: its kind (swapped back in it)
        # One page of growth is reserved per running request, so admissions do not force memory
        # preemptions a few steps later (measured: 47 -> 14 preemptions, ShareGPT 4 req/s, simulated).
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
        values = value[rest, None] - kind_weight[rest, None] * self._per_page[kinds][None, :]
        if c.copy is not None:
            self._price_recompute(c, rest, kinds, values, allowed)
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
                               memory_weight=self.weights.memory_weight)
        chosen = first.copy()
        kind = np.where(first, np.maximum(current, 0), SKIP)
        chosen[rest] = choice.option >= 0
        kind[rest] = np.where(chosen[rest], np.asarray(kinds)[np.maximum(choice.option, 0)], SKIP)
        if reserved >= 0 and capacity < 0:
            # Its pages are not free yet: it waits for them (a chunk started in the pages there are
            # would take the running requests' growth and preempt them), and nobody takes them first.
            chosen[reserved], kind[reserved] = False, SKIP
            reserved = -1
        density = self.weights.density(value, c.mem_kv)
        forced_idx = np.flatnonzero(forced)
        forced_idx = forced_idx[np.argsort(c.arrival[forced_idx], kind="stable")]
        if reserved >= 0:
            forced_idx = np.append(forced_idx, reserved)  # after the protected, before everyone else
        others = np.flatnonzero(chosen & ~forced)
        others = others[others != reserved]
        order = np.concatenate((forced_idx, others[np.argsort(-density[others], kind="stable")]))
        plan = Plan(value, density, forced, pinned, chosen, kind, order, capacity - choice.pages)
        if (kind[n_run:] > 0).any():
            self._cap_compressed(c, plan)
        if self.priority_preemption and n > n_run and c.priority is not None:
            self._preempt_for_priority(c, plan)
        if self.admission_share is not None and self.step_model is not None and n > n_run:
            admit_within_promise(c, plan, reserved, step_model=self.step_model, per_page=self._per_page,
                                 admission_share=self.admission_share,
                                 target_scale=self.tbt_headroom / self.slowdown / 1000.0)
        return plan

    def _price_recompute(self, c: Candidates, rest: np.ndarray, kinds: list[int], values: np.ndarray,
                         allowed: np.ndarray) -> None:
        """A waiting request whose tokens wait in the tier comes back in the copy's kind, or converted
        (``can_convert``: quantised to its int8 kind) at no extra cost; any other kind drops the copy and
        recomputes its tokens, which delays the U requests that can still pass (priced as an eviction),
        and at least the request itself: with U = 0 (all late) a free recompute tied with the copy and
        the greedy's zero-value upgrade step threw the copy away whenever the KV pages fitted. Without
        a step-time model to price it, a copy is never thrown away."""
        copy = c.copy[rest]
        has_copy = copy >= 0
        if not has_copy.any():
            return
        lost = has_copy[:, None] & ~_COMES_BACK_AS[np.maximum(copy, 0)][:, kinds]
        if self.step_model is None:
            allowed &= ~lost
            return
        redo_s = max(1, int((~c.missed).sum())) * recompute_seconds(self.step_model,
                                                                  c.num_computed[rest].astype(np.float64))
        values -= np.where(lost, redo_s[:, None], 0.0)

    def _preempt_for_priority(self, c: Candidates, plan: Plan) -> None:
        """Let a waiting request that does not fit, and can still meet its SLO, take the pages of pinned
        running requests of a lower priority (a larger value), when it is worth more than they are together (their values
        include what evicting them costs: ``_price``). Waiting requests in density order; victims of
        the lowest priority first, then the lowest density; never the protected, never one of the same
        or a higher priority (so requests of one class never evict each other: no thrashing). The
        victims become unchosen, the first ones ``_run`` evicts for a waiting request."""
        n_run, prio, value = c.num_running, c.priority, plan.value
        # Only for a request that can still meet its SLO: evicting for those that have already missed
        # too was worse for both classes (LongBench-like, 1.5x: 16% / 40% against 24% / 51%).
        waiting = np.flatnonzero(~plan.chosen[n_run:] & ~c.missed[n_run:]) + n_run
        running = np.flatnonzero(plan.pinned[:n_run] & plan.chosen[:n_run])
        if not waiting.size or not running.size or prio[waiting].min() >= prio[running].max():
            return
        victims = running[np.lexsort((plan.density[running], -prio[running]))].tolist()
        changed = False
        for i in waiting[np.argsort(-plan.density[waiting], kind="stable")].tolist():
            short = int(c.mem_kv[i]) - plan.spare
            pick, freed, lost = [], 0, 0.0
            for v in victims:
                if short <= freed or prio[v] <= prio[i]:
                    break
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

    def _forced(self, ctx, c: Candidates) -> np.ndarray:
        """Rows protected from starvation: waited ``max_wait_time`` once, protected until finished."""
        if self._protected:
            self._protected &= set(c.requests) | set(ctx.running)
        overdue = np.flatnonzero(c.pending_s > self.max_wait_time)
        self._protected.update(c.requests[i] for i in overdue)
        if not self._protected:
            return np.zeros(c.num, dtype=bool)
        return np.fromiter(map(self._protected.__contains__, c.requests), dtype=bool, count=c.num)

    def kind_pays_for_throughput(self, num_pages: int, page_ratio: float, per_page: float) -> bool:
        """Whether filling memory with requests of a compressed kind raises decode throughput at all.

        With the pool full, N requests of which x hold the kind (``page_ratio`` h: its pages per KV
        page for the same tokens): every request beyond the KV capacity K needs ``1 / (1 - h)``
        conversions, so the step is ``T(N) = a + beta N + r L (N - K) / (1 - h)`` (a: the fixed step
        cost, beta: per request, r: the kind's extra seconds per context token, L: context per
        request). Tokens per second N / T(N) grow with N exactly when ``a > r * K * L / (1 - h)``,
        whatever N is: the fixed cost a step amortises must exceed the extra time of the KV capacity's
        worth of tokens held in the kind. On a GPU decode is memory-bound and ``a`` (reading the
        weights) dominates; on a CPU the hidden kind's recompute usually does (OPT-125m, 2 cores: a =
        3-4 ms, r = 2 us/token, 6,048-token pool: 25 ms; a pool of hidden requests ran 0.65x KV's
        tokens per second), while int8 dequantisation may cost little enough. ``r * K * L`` is
        ``per_page * num_pages`` (seconds per KV page of context, KV pages). h >= 1 (no saving):
        never pays unless free.
        """
        if self.step_model is None or not per_page:
            return True
        fixed = self.step_model.predict(1, 1)
        return fixed > per_page * num_pages / max(1e-9, 1.0 - page_ratio)

    def hidden_pays_for_throughput(self, num_pages: int, hidden_ratio: float) -> bool:
        """``kind_pays_for_throughput`` for the hidden kind (rho; ``hidden_ratio``: layout.hidden_ratio)."""
        return self.kind_pays_for_throughput(num_pages, hidden_ratio, self.rho)

    def _held_extra_s(self, c: Candidates, rows) -> float:
        """Predicted extra seconds of a decode step from ``rows`` holding int8 kinds (the hidden kind's
        recompute is in the step-time model's own hidden term)."""
        return float(int8_seconds(self._per_page, c.held[rows], c.mem_kv[rows]).sum())

    def _cap_compressed(self, c: Candidates, plan: Plan) -> None:
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
        if self.step_model is None or not self._per_page.any():
            return
        order, kind, need = plan.order, plan.kind, c.need
        target = self.tbt_headroom * float(c.tbt_slo_ms[order].min()) / 1000.0
        decodes = c.is_decoding
        base = self.step_model.predict(int(decodes.sum()), int(need[decodes].sum()),
                                       int(need[decodes & c.is_hidden].sum()))
        base += self._held_extra_s(c, np.flatnonzero(decodes))
        headroom, spare, dropped = target - base, plan.spare, []
        for i in order[(order >= c.num_running) & (kind[order] > 0)].tolist():
            k = kind[i]
            cost = self._per_page[k] * c.mem_kv[i]
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
