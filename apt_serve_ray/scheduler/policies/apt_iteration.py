"""Stage 4 of the adaptive policy (``apt.py``): shape the iteration from the plan ``_choose`` made.

Who runs this step, in which order, with how many prefill tokens, and whom to preempt when pages run
short. A mixin of ``AdaptiveScheduler``: it reads the policy's step-time model and protected set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apt_serve_ray.request import CacheKind, RequestStatus
from apt_serve_ray.scheduler.candidates import KINDS, Candidates
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


class IterationShaper:
    def _shape(self, ctx, c: Candidates, plan: Plan) -> None:
        """Run the chosen: decodes and prefills in the paper's order, prefills under the step-time budget."""
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
        prefill_budget = self._prefill_budget(ctx, c, decodes)
        if c.pending_s[n_run:].sum() > c.pending_s[:n_run].sum():
            self._run(ctx, c, plan.kind, prefills, prefill_budget, victims, evictable)
            self._run(ctx, c, plan.kind, decodes, ctx.token_budget, victims, evictable)
        else:
            self._run(ctx, c, plan.kind, decodes, ctx.token_budget, victims, evictable)
            self._run(ctx, c, plan.kind, prefills, prefill_budget, victims, evictable)
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
                                       int(ctx_tokens[c.is_hidden[decodes]].sum())) + self._held_extra_s(c, decodes)
        room = int((target - base) / self._prefill_token_s())
        # Leave one token per decode: prefill-first steps must not make every decode skip the step.
        return max(1, min(max(ctx.cache.layout.block_size, min(budget, room)), budget - len(decodes)))

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
