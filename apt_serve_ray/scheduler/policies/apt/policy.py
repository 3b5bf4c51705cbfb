"""The adaptive SLO-aware policy (Apt-Serve, SPEC section 2), with three measured corrections.

Every step, over one table of candidates (``Candidates``: running requests not yet scheduled, then
admissible waiting ones) held in one ``Decision`` (``decision.py``), in four stages, each a module of
functions of that decision:

1. **Price** (``price.py``). The value model (``scheduler/value.py``) with the operator's weights. A
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
2. **Choose** (``choose.py``). Running requests that can still pass keep their memory (first
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
   correction, ``cap_compressed``): the predicted decode step with every compressed kind's extra
   time must stay under the tightest TBT target. A kind is offered to new requests only where it can
   raise throughput at all (``kind_pays_for_throughput``) and the runner could run it at calibration.
3. **Change kinds in place, admit, preempt** (``kinds.py``, ``shape.run``). When memory alone keeps the
   most valuable waiting request out, pinned running requests are compressed in place to an offered
   int8 kind (fourth correction: pinning left an arrival outside a full pool of KV requests until one
   finished; simulated ShareGPT-like, all kinds at ceiling 1.0: attainment at 3 req/s 50% -> 92%,
   effective throughput at 90% 1.55 -> 3.0 req/s, the top rate of the sweep). Chosen waiting requests are admitted with their kind (a swapped one in its copy's
   kind, converted to int8 on the way in, or recomputed where that is priced cheaper); unchosen
   running ones are preempted only when their pages are needed; running requests of a compressed
   kind chosen as KV are upgraded in place, and pinned ones go back to KV while pages allow and
   nobody waits.
4. **Shape the iteration** (``shape.py``). A step is a promise to every decoding request that
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

**Admission as a promise** (issue 44; ``admission.py``, applied in ``choose``). Stage 4 bounds each step,
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
it is worth more than they are together, evicting them (``choose.preempt_for_priority``); and when a running
request needs pages to grow, the least important go first (``shape.shape``'s victim order). Eviction is priced as
what it costs: a swap out and back where the tier below memory has room, else a recompute. A victim
that can still pass is taken only if it can be back before its next token is late: the waiting request
must finish (prefill, then its ``max_tokens`` at today's step time) and the victim return within what is
left of its TTFT or gap allowance (``evict_within_promise``, issue 44: documents with a 1-s gap were
evicted for chats that held their pages for seconds, and lost to vLLM's FCFS on their gaps). Measured
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

from collections import deque

import numpy as np

from apt_serve_ray.scheduler.candidates import KIND_CODE, KINDS, Candidates, WaitingRows
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.policies.apt.choose import choose
from apt_serve_ray.scheduler.policies.apt.decision import Decision
from apt_serve_ray.scheduler.policies.apt.kinds import compress_for_waiting, set_kinds
from apt_serve_ray.scheduler.policies.apt.price import price, write_off
from apt_serve_ray.scheduler.policies.apt.shape import shape, step_budget
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy
from apt_serve_ray.scheduler.registry import register_policy
from apt_serve_ray.scheduler.value import FAIRNESS_PENALTY, MAX_WAIT_S, ValueWeights


# ``step_margin_quantile``: the steps whose prediction error sets the margin (those predicted at 0.1 s or
# more), and how many before the quantile replaces the envelope.
STEP_ERROR_WINDOW = 200
STEP_ERROR_MIN_SAMPLES = 20


@register_policy
class AdaptiveScheduler(SchedulingPolicy):
    name = "apt"

    def __init__(
        self, time_weight: float = ValueWeights.time_weight, memory_weight: float = ValueWeights.memory_weight,
        slo_weight: float = ValueWeights.slo_weight, priority_weight: float = ValueWeights.priority_weight,
        fairness_penalty: float = FAIRNESS_PENALTY, max_wait_time: float = MAX_WAIT_S,
        *, config=None, rho: float | None = None, step_model=None, tbt_headroom: float = 0.8,
        hidden_cost_steps: float = 8.0, evict_missed: bool = False, priority_preemption: bool = True,
        admission_share: float | None = 0.8, reserve_after: float | None = 0.5, write_off_late: bool = True,
        shed_late: bool = False, step_margin_quantile: float | None = None, evict_within_promise: bool = True,
        write_off_fewest: bool = True, keep_reservation: bool = True,
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
        if step_margin_quantile is not None and not 0.5 <= step_margin_quantile <= 1.0:
            raise ValueError(f"step_margin_quantile: must be in [0.5, 1] or None, got {step_margin_quantile!r}")
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
        # ... but only victims that have missed, or that can be back before their next token is late
        # (``choose.promise_times``): evicting a decoding request for a request that holds its pages
        # longer than the victim's gap allowance breaks the victim's promise (issue 44: documents with
        # a 1 s gap evicted for chats that ran for seconds). False: any victim of a lower priority.
        self.evict_within_promise = bool(evict_within_promise)
        # Admission as a promise (issue 44): a waiting request starts only while the decode step with it
        # (and everyone before it) stays within ``admission_share`` of the step's time target (the
        # rest is left to prefill chunks); None: admit whatever memory allows, as before.
        self.admission_share = admission_share
        # No class starves: the oldest waiting request that can still pass, once it has waited
        # ``reserve_after`` of its TTFT target, has its pages reserved (nobody is admitted into them
        # ahead of it) and starts first; one at a time. None: off.
        self.reserve_after = reserve_after
        # ... and keeps it, once admitted, until its first token (False: passed on at admission, as before).
        self.keep_reservation = bool(keep_reservation)
        self.reserved = None  # the request that holds the reservation (``admission.reserved_row``)
        # Lost before they start (issue 44): a waiting request whose first token the step-time model
        # says cannot come in time, even in deadline order, is written off as one already late.
        self.write_off_late = bool(write_off_late)
        # ... as few of each priority as can be (the longest go first: ``admission.fewest_late``);
        # False: each one that does not fit after those kept, in turn (as before).
        self.write_off_fewest = bool(write_off_fewest)
        # Where the deployment sheds (off by default): such a request that holds nothing yet is turned
        # away at once (503 + Retry-After through the server) instead of running late, behind the rest.
        self.shed_late = bool(shed_late)
        self.protected: set = set()  # Request objects that waited max_wait_time (choose.protected_rows)
        self._waiting_rows = WaitingRows()
        self.predictor = None  # a TrafficPredictor (``enable_prediction``); the engine feeds it arrivals
        self.slowdown = 1.0  # measured / predicted step seconds lately (``observe_step``)
        # The margin a step's prediction is scaled by: None, an envelope of the ratio that rises fast and
        # falls slowly; q, the q-quantile of the last ``STEP_ERROR_WINDOW`` ratios (issue 44, item 4).
        self.step_margin_quantile = step_margin_quantile
        self._step_ratios: deque[float] = deque(maxlen=STEP_ERROR_WINDOW)
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
        d = Decision(self, ctx, cands, np.array([self.costs.seconds_per_page(k) for k in KINDS]),  # KV: 0
                     ctx.cache, ctx.num_free_swap_slots, self.offered_kinds(ctx))
        if self.write_off_late and self.step_model is not None:
            write_off(d)
        price(d)
        choose(d)
        d.plan.budget = step_budget(d)
        compress_for_waiting(d)
        set_kinds(d)
        shape(d)

    def offered_kinds(self, ctx) -> list[int]:
        """Indices in KINDS of the compressed kinds new requests may get now: those the engine offers
        under ``cache_ratio``, the runner could run at calibration, and that can raise throughput."""
        kinds, unavailable = ctx.compressed_kinds, self.costs.unavailable
        if not kinds:
            return []
        pool_pages, layout = ctx.cache.pool.num_pages, ctx.cache.layout
        return [KIND_CODE[k] for k in kinds if k not in unavailable and self.kind_pays_for_throughput(
            pool_pages, layout.block_size / max(1, layout.tokens_per_page(k)), self.costs.seconds_per_page(k))]

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

    def observe_sampling(self, mask_s_per_row: float, adjust_s_per_row: float) -> None:
        """What the sampler measured a structured-output row's mask (and matcher advance) and a row's
        logit bias and penalties to cost (seconds a row): priced into every step that decodes them."""
        self.sampling_costs = (mask_s_per_row, adjust_s_per_row)


    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """Track how much longer than predicted the steps that carry prefill run here and now
        (``slowdown``): a model timed at start does not see what shares the machine with the engine
        later (through Ray Serve on 2 cores, mixed steps ran 1.06x their prediction at the median and
        1.17x at P90, where they had run 1.00x / 1.13x in-process). The estimate rises fast and falls
        slowly, towards the upper envelope of the ratio, since a step that runs long breaks a promise
        and one that runs short only wastes a little. Only steps predicted at 0.1 s or more count:
        those are the ones the budget sizes, and in shorter ones the engine's fixed costs outside the
        model (scheduling, outputs: ~1-2 ms) would read as a slowdown."""
        if predicted_s < 0.1 or not measured_s > 0:
            return
        ratio = min(3.0, max(0.5, measured_s / predicted_s))
        if self.step_margin_quantile is not None:
            self._step_ratios.append(ratio)
            if len(self._step_ratios) >= STEP_ERROR_MIN_SAMPLES:
                self.slowdown = float(np.quantile(self._step_ratios, self.step_margin_quantile))
                return
        rate = 0.3 if ratio > self.slowdown else 0.03
        self.slowdown += rate * (ratio - self.slowdown)
