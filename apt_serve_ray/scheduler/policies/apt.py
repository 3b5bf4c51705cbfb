"""The adaptive SLO-aware policy (Apt-Serve, SPEC section 2).

Every step:

1. Score every candidate (running requests not yet scheduled, admissible waiting ones):
   value = time_weight * pending + slo_weight * urgency + priority_weight * importance, where a
   request that can no longer meet its SLO keeps only ``fairness_penalty`` of its pending time (it
   loses value but never reaches zero, so it is never stuck); ``U`` counts those that can still meet
   it, and choosing the hidden kind costs ``U * rho * m`` (rho: measured seconds to recompute one
   page of K/V per step, m: the request's pages with a full KV cache).
2. Requests past ``max_wait_time`` are served first, oldest first, outside the knapsack.
3. The greedy 2-approximation (``knapsack.greedy_select``) picks who holds memory and in which kind,
   under the free pages plus the pages the running candidates already hold.
4. Apply it: running requests that lost their place are preempted only when the memory is needed
   (a running request costs no new memory, so it keeps running otherwise); running hidden requests
   chosen as KV are upgraded in place; chosen waiting requests are admitted with their kind.
5. Iteration shape (paper): if the summed pending time of the waiting exceeds that of the running,
   prefills go first with the whole token budget; otherwise decodes go first and prefill chunks
   get ``decode_first_prefill_share`` of the budget, so long prompts do not stall decodes.

Running KV requests are never switched to hidden: x is gone, it would be a preemption with
recompute, which costs more than the memory it would save for one step.
"""

from __future__ import annotations

import math

import numpy as np

from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.scheduler.knapsack import greedy_select, urgency
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy, run_running
from apt_serve_ray.scheduler.registry import register_policy


@register_policy
class AdaptiveScheduler(SchedulingPolicy):
    name = "apt"

    def __init__(
        self, time_weight: float = 1.0, memory_weight: float = 1.0, slo_weight: float = 0.0,
        priority_weight: float = 0.0, fairness_penalty: float = 0.1, max_wait_time: float = 60.0,
        *, config=None, rho: float | None = None, decode_first_prefill_share: float = 0.25,
    ) -> None:
        super().__init__(config)
        for name, value in (("time_weight", time_weight), ("memory_weight", memory_weight),
                            ("slo_weight", slo_weight), ("priority_weight", priority_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not 0.0 < fairness_penalty <= 1.0:
            raise ValueError(f"fairness_penalty: must be in (0, 1], got {fairness_penalty!r}")
        if not max_wait_time > 0:
            raise ValueError(f"max_wait_time: must be > 0 seconds, got {max_wait_time!r}")
        if rho is not None and not rho >= 0:
            raise ValueError(f"rho: must be >= 0 seconds per page, got {rho!r}")
        if not 0.0 < decode_first_prefill_share <= 1.0:
            raise ValueError(f"decode_first_prefill_share: must be in (0, 1], got {decode_first_prefill_share!r}")
        self.time_weight, self.memory_weight = float(time_weight), float(memory_weight)
        self.slo_weight, self.priority_weight = float(slo_weight), float(priority_weight)
        self.fairness_penalty, self.max_wait_time = float(fairness_penalty), float(max_wait_time)
        self.rho = rho
        self.decode_first_prefill_share = decode_first_prefill_share
        self.last_decision: dict = {}
        self._protected: set[str] = set()

    def bind(self, engine) -> None:
        """Called by the engine when the policy is installed: calibrate rho by timing, once."""
        if self.config is None:
            self.config = engine.config
        if self.rho is None:
            if engine.hidden_allowed and engine.config.calibrate_rho:
                from apt_serve_ray.calibration import calibrate_rho

                self.rho = calibrate_rho(engine.runner).seconds_per_page
            else:
                self.rho = 0.0

    # ----------------------------------------------------------------------------------------------
    def schedule(self, ctx) -> None:
        now = ctx.now
        running = [r for r in ctx.running if not ctx.is_scheduled(r)]
        waiting = [r for r in ctx.waiting if ctx.can_admit(r)]
        candidates = running + waiting
        if not candidates:
            return
        n_run = len(running)
        lay = ctx.cache.layout
        need = np.fromiter((r.num_tokens + 1 for r in candidates), dtype=np.int64, count=len(candidates))
        mem_kv = -(-need // lay.tokens_per_page(CacheKind.KV))
        mem_hidden = -(-need // lay.tokens_per_page(CacheKind.HIDDEN))
        hidden_ok = np.zeros(len(candidates), dtype=bool)
        if ctx.hidden_allowed:
            hidden_ok[:n_run] = [r.kind is CacheKind.HIDDEN for r in running]
            hidden_ok[n_run:] = True
        pending = np.fromiter((r.pending_time(now) for r in candidates), dtype=np.float64, count=len(candidates))
        deadline = np.fromiter((r.deadline() for r in candidates), dtype=np.float64, count=len(candidates))
        meetable = deadline >= now
        # Starvation bound: once a request has waited max_wait_time it is protected until it finishes:
        # served first (oldest first), outside the knapsack, and never chosen as a victim.
        self._protected &= {r.request_id for r in ctx.running} | {r.request_id for r in ctx.waiting}
        self._protected |= {r.request_id for r, p in zip(candidates, pending) if p > self.max_wait_time}
        forced = np.fromiter((r.request_id in self._protected for r in candidates), dtype=bool, count=len(candidates))
        value = self._values(candidates, pending, deadline, meetable, now)
        u = int(meetable.sum())
        recompute_cost = u * (self.rho or 0.0) * mem_kv

        held = sum(len(r.page_ids) for r in running)
        capacity = ctx.num_free_pages + held
        # The protected take their KV memory first, then the knapsack runs on the rest.
        forced_idx = sorted(np.flatnonzero(forced).tolist(), key=lambda i: candidates[i].arrival_time)
        capacity -= int(mem_kv[forced_idx].sum()) if forced_idx else 0
        rest = np.flatnonzero(~forced)
        sel = greedy_select(value[rest], recompute_cost[rest], mem_kv[rest], mem_hidden[rest], hidden_ok[rest],
                            max(0, capacity), memory_weight=self.memory_weight)
        chosen = np.zeros(len(candidates), dtype=bool)
        hidden = np.zeros(len(candidates), dtype=bool)
        chosen[rest], hidden[rest] = sel.chosen, sel.hidden
        density = value / np.maximum(mem_kv, 1) ** self.memory_weight
        order = forced_idx + sorted((int(i) for i in rest[sel.chosen]), key=lambda i: -density[i])
        self.last_decision = {"num_candidates": len(candidates), "num_chosen": len(order), "U": u,
                              "num_forced": len(forced_idx), "num_hidden": int(hidden.sum()), "capacity": capacity}

        # Running hidden requests the knapsack wants as KV: upgrade in place (if the pages are there).
        for i in order:
            r = candidates[i]
            if i < n_run and r.kind is CacheKind.HIDDEN and not hidden[i] and not forced[i]:
                ctx.upgrade(r)

        waiting_pressure = pending[n_run:].sum()
        running_pressure = pending[:n_run].sum()
        is_decode = [i < n_run and candidates[i].is_decoding for i in range(len(candidates))]
        decodes = [i for i in order if is_decode[i]]
        prefills = [i for i in order if not is_decode[i]]
        victims = sorted((i for i in range(n_run) if not chosen[i] and not forced[i]), key=lambda i: density[i])
        run = lambda idx, budget: self._run(ctx, candidates, n_run, idx, hidden, victims, budget)  # noqa: E731
        if waiting_pressure > running_pressure:
            run(prefills, ctx.token_budget)
            run(decodes, ctx.token_budget)
        else:
            run(decodes, ctx.token_budget)
            share = max(1, int(self.config.max_num_batched_tokens * self.decode_first_prefill_share))
            run(prefills, min(ctx.token_budget, share))
        # Unchosen running requests that still hold their pages keep decoding if budget remains.
        self._run(ctx, candidates, n_run, [i for i in range(n_run) if not chosen[i]], hidden, [], ctx.token_budget)
        if ctx.num_scheduled == 0 and ctx.running:
            # Liveness: page estimates can be off by rounding; never let a step schedule nothing
            # while requests hold memory. Fall back to preempting the lowest-value running request.
            lowest = {id(candidates[i]): density[i] for i in range(n_run)}
            key = lambda r: (r.request_id not in self._protected, -lowest.get(id(r), 0.0))  # noqa: E731
            run_running(ctx, sorted(ctx.running, key=key), victim_key=key, chunked=True)

    def _values(self, candidates: list[Request], pending, deadline, meetable, now) -> np.ndarray:
        effective = np.where(meetable, pending, self.fairness_penalty * pending)
        value = self.time_weight * effective
        if self.slo_weight:
            slack = np.fromiter(((r.ttft_slo_ms if r.last_token_time is None else r.tbt_slo_ms) / 1000.0
                                 for r in candidates), dtype=np.float64, count=len(candidates))
            value = value + self.slo_weight * np.where(meetable, urgency(now, deadline, slack), self.fairness_penalty)
        if self.priority_weight:
            # vLLM convention: lower priority value = more important; importance is its negation, shifted >= 0.
            prio = np.fromiter((r.priority for r in candidates), dtype=np.float64, count=len(candidates))
            value = value + self.priority_weight * (prio.max() - prio)
        return value

    def _run(self, ctx, candidates, n_run: int, indices, hidden, victims: list[int], budget: int) -> None:
        """Schedule ``indices`` in order while ``budget`` tokens last; preempt ``victims`` (lowest
        density first) when pages are short."""
        for i in indices:
            r = candidates[i]
            if r.is_finished or ctx.is_scheduled(r) or budget <= 0 or ctx.num_seqs_left <= 0:
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
                victim = next((v for v in victims if candidates[v].status is RequestStatus.RUNNING
                               and candidates[v] is not r), None)
                if victim is None or ctx.cache.can_allocate(r, r.num_computed_tokens + n, kind):
                    break
                victims.remove(victim)
                ctx.preempt(candidates[victim], cause="policy" if i >= n_run else "memory")
            else:
                budget -= n
