"""Stage 4 of the adaptive policy (``apt.py``): shape the iteration from the plan ``_choose`` made.

Who runs this step, in which order, with how many prefill tokens, and whom to preempt when pages run
short. A mixin of ``AdaptiveScheduler``: it reads the policy's step-time model and protected set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apt_serve_ray.request import CacheKind, RequestStatus
from apt_serve_ray.scheduler.candidates import KINDS, Candidates
from apt_serve_ray.scheduler.costs import chunk_pairs
from apt_serve_ray.scheduler.policies.base import run_running


@dataclass
class Plan:
    """What ``_choose`` decided, per candidate row."""

    value: np.ndarray
    density: np.ndarray
    forced: np.ndarray  # protected: first, oldest first, never a victim
    pinned: np.ndarray  # running requests that keep their memory and kind
    chosen: np.ndarray
    kind: np.ndarray  # the chosen kind's index in KINDS (0: KV); SKIP where not chosen
    order: np.ndarray  # chosen rows: the forced by arrival, then by density
    spare: int  # pages left after the chosen and one page of growth per running request
    budget: StepBudget | None = None  # the step's seconds (``IterationShaper._step_budget``), set after choosing


@dataclass
class StepBudget:
    """The seconds this step may still grow by while it keeps its promise to the decoding requests that
    can still pass: ``tbt_headroom`` x the tightest of their TBT targets, less the predicted decode rows
    and what kind changes and transfers planned so far take (inf: nobody to protect, or no model).
    Every stage that adds work to the step spends from it: in-place compressions and upgrades, swap-ins,
    then the prefill chunks, sized to what is left."""

    target_s: float | None
    left_s: float  # in the step-time model's seconds (the target divided by the measured slowdown)
    extra_s: float = 0.0  # spent on kind changes and transfers (the engine adds it to the chunks' prediction)

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left_s

    def spend(self, seconds: float, *, extra: bool = False) -> None:
        self.left_s -= seconds
        if extra:
            self.extra_s += seconds


class IterationShaper:
    def _shape(self, ctx, c: Candidates, plan: Plan) -> None:
        """Run the chosen: decodes, then prefill chunks sized so that the step keeps its promise to the
        decoding requests that can still pass (``_step_target``), then unchosen running requests."""
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
        unchosen = np.flatnonzero(~plan.chosen[:n_run]).tolist()
        evictable = set(unchosen)
        # Decodes first, those that can still pass before those that cannot (one token each: the
        # token budget never splits them), then the prefill chunks in the plan's order, each as long
        # as the step's time left allows.
        decodes.sort(key=lambda i: bool(c.missed[i]))
        self._run(ctx, c, plan.kind, decodes, ctx.token_budget, victims, evictable)
        self._run_prefills(ctx, c, plan, prefills, victims, evictable)
        if plan.budget is not None:
            ctx.planned_extra_s = plan.budget.extra_s
        # Unchosen running requests still holding pages keep decoding while the budget lasts.
        self._run(ctx, c, plan.kind, unchosen, ctx.token_budget, [], set())
        if ctx.num_scheduled == 0 and ctx.running:
            # Liveness: page estimates can be off by rounding; never let a step schedule nothing
            # while requests hold memory. Fall back to preempting the lowest-value running request.
            rank = {id(c.requests[i]): plan.density[i] for i in range(n_run)}
            key = lambda r: (r not in self._protected, -rank.get(id(r), 0.0))  # noqa: E731
            run_running(ctx, sorted(ctx.running, key=key), victim_key=key, chunked=True)

    def _prefill_token_s(self) -> float:
        return max(self.step_model.predict(1, 1) - self.step_model.predict(0, 0), 1e-9)

    def _step_target(self, c: Candidates, rows) -> float | None:
        """The seconds a step may take: ``tbt_headroom`` x the tightest TBT target among ``rows`` that
        can still pass (a request whose gaps so far leave its P99 no way under its target is not
        protected: it yields to those that can). None: nobody to protect."""
        rows = np.asarray(rows, dtype=np.int64)
        live = rows[~c.missed[rows]] if rows.size else rows
        if not live.size:
            return None
        return self.tbt_headroom * float(c.tbt_slo_ms[live].min()) / 1000.0

    def _step_budget(self, c: Candidates) -> StepBudget:
        """The step's budget before any kind change: the target over the running requests that decode
        this step, in the model's seconds (divided by how much slower than predicted steps have run
        lately, ``observe_step``), less their predicted decode rows (with what their int8 pages add)."""
        rows = np.flatnonzero(c.is_decoding[: c.num_running])
        target = self._step_target(c, rows) if self.step_model is not None else None
        if target is None:
            return StepBudget(None, float("inf"))
        chunks = [(int(c.num_computed[i]), 1, bool(c.is_hidden[i])) for i in rows.tolist()]
        return StepBudget(target, target / self.slowdown - self._predict(chunks) - self._held_extra_s(c, rows))

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """Track how much longer than predicted steps run here and now (``slowdown``): a model timed at
        start does not see what shares the machine with the engine later (through Ray Serve on 2
        cores, mixed steps ran 1.06x their prediction at the median and 1.17x at P90, where they had
        run 1.00x / 1.13x in-process). The estimate rises fast and falls slowly, towards the upper
        envelope of the ratio, since a step that runs long breaks a promise and one that runs short
        only wastes a little; steps under 20 ms (launch and Python costs dominate) are not counted."""
        if predicted_s < 0.02 or not measured_s > 0:
            return
        ratio = min(3.0, max(0.5, measured_s / predicted_s))
        rate = 0.3 if ratio > self.slowdown else 0.03
        self.slowdown += rate * (ratio - self.slowdown)

    def _run_prefills(self, ctx, c: Candidates, plan: Plan, prefills: list[int], victims: list[int],
                      evictable: set[int]) -> None:
        """Prefill chunks in order, each of the most tokens whose predicted time fits what is left of the
        step's budget (``plan.budget``; a request coming back from the tier also pays its pages' way in);
        without a promise to keep, the token budget alone. The first chunk gets at least one page's
        worth, so prefills progress even when the decodes alone fill the step."""
        budget = plan.budget
        if budget is None or budget.target_s is None:
            self._run(ctx, c, plan.kind, prefills, ctx.token_budget, victims, evictable)
            return
        floor = ctx.cache.layout.block_size
        transfer = getattr(getattr(ctx.cache, "swap", None), "transfer", None)
        for k, i in enumerate(prefills):
            r = c.requests[i]
            if r.is_finished or ctx.is_scheduled(r):
                continue
            start, hidden = r.num_computed_tokens, bool(c.is_hidden[i])
            swap_in_s = len(r.swap_slots) * transfer.in_s_per_page if (r.swap_slots and transfer) else 0.0
            n = self._chunk_fitting(start, budget.left_s - swap_in_s, hidden)
            n = max(n, min(floor, r.num_tokens_to_compute) if k == 0 else 0)
            if n <= 0:
                break
            before = ctx.token_budget
            self._run(ctx, c, plan.kind, [i], min(n, before), victims, evictable)
            if ctx.token_budget < before:
                budget.spend(self._chunk_s(start, before - ctx.token_budget, hidden))
                budget.spend(swap_in_s, extra=True)

    def _predict(self, chunks: list[tuple[int, int, bool]]) -> float:
        """Predicted seconds of a step of ``(start, tokens, hidden)`` chunks."""
        tokens = context = hidden = pairs = 0
        for start, n, is_hidden in chunks:
            tokens += n
            context += start + n
            hidden += (start + n) if is_hidden else 0
            pairs += chunk_pairs(start, n)
        return self.step_model.predict(tokens, context, hidden, pairs)

    def _chunk_s(self, start: int, n: int, hidden: bool) -> float:
        """What a prefill chunk of ``n`` tokens from ``start`` adds to a step."""
        ctx = start + n
        return (self.step_model.predict(n, ctx, ctx if hidden else 0, chunk_pairs(start, n))
                - self.step_model.predict(0, 0))

    def _chunk_fitting(self, start: int, seconds: float, hidden: bool, limit: int = 1 << 16) -> int:
        """The most tokens a chunk from ``start`` may have while adding at most ``seconds`` (0 if none)."""
        if seconds <= 0 or self._chunk_s(start, 1, hidden) > seconds:
            return 0
        lo, hi = 1, limit
        while lo < hi:  # the chunk's time rises with its tokens
            mid = (lo + hi + 1) // 2
            if self._chunk_s(start, mid, hidden) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _run(self, ctx, c: Candidates, kinds: np.ndarray, rows: list[int], budget: int, victims: list[int],
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
            if r.kind is None or r.swap_slots:  # new, or back from the tier: the chosen kind (KV where none)
                kind = KINDS[kinds[i]] if kinds[i] > 0 else CacheKind.KV
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
