"""One decision of the adaptive policy: what every stage reads and writes, built once per call.

``Decision`` holds the step's context, the candidates' table (``Candidates``), what the policy's
costs say now (each kind's seconds per page, the tier's room), the prices (``price.py``), the plan
(``choose.py``) and the step's budget (``StepBudget``, set once the plan is made). The stages are
functions of a ``Decision``; the policy (``policy.py``) keeps only its settings, its costs and what
it learns across steps (the measured slowdown, the sampler's costs, the protected requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from apt_serve_ray.scheduler.candidates import Candidates
from apt_serve_ray.scheduler.policies.apt.admission import int8_seconds


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
        """Whether ``seconds`` more keep the step within its budget (work that costs nothing always does)."""
        return seconds <= max(self.left_s, 0.0)

    def spend(self, seconds: float, *, extra: bool = False) -> None:
        self.left_s -= seconds
        if extra:
            self.extra_s += seconds


@dataclass
class Plan:
    """What ``choose`` decided, per candidate row."""

    value: np.ndarray
    density: np.ndarray
    forced: np.ndarray  # protected: first, oldest first, never a victim
    pinned: np.ndarray  # running requests that keep their memory and kind
    chosen: np.ndarray
    kind: np.ndarray  # the chosen kind's index in KINDS (0: KV); SKIP where not chosen
    order: np.ndarray  # chosen rows: the forced by arrival, then by density
    spare: int  # pages left after the chosen and one page of growth per running request
    # The step's seconds (``shape.step_budget``), set after choosing; until then, no promise.
    budget: StepBudget = field(default_factory=lambda: StepBudget(None, math.inf))


@dataclass
class Decision:
    policy: object  # the AdaptiveScheduler: settings, costs, learnt state (read; ``protected`` updated)
    ctx: object  # the SchedulingContext
    c: Candidates
    per_page: np.ndarray  # each kind's extra decode seconds per KV page of context held in it (KV: 0)
    cache: object  # ctx.cache
    free_swap_slots: int  # room in the tier below memory
    offered: list[int] = field(default_factory=list)  # compressed kinds new requests may get (KINDS indices)
    value: np.ndarray | None = None  # ``price``: each candidate's value
    kind_weight: np.ndarray | None = None  # ``price``: times a kind's seconds per page, what choosing it costs
    plan: Plan | None = None  # ``choose``

    @property
    def step_model(self):
        return self.policy.step_model

    def held_extra_s(self, rows) -> float:
        """Predicted extra seconds of a decode step from ``rows`` holding int8 kinds (the hidden kind's
        recompute is in the step-time model's own hidden term)."""
        return float(int8_seconds(self.per_page, self.c.held[rows], self.c.mem_kv[rows]).sum())

    def decode_seconds(self, rows) -> float:
        """The step-time model's seconds of a step that decodes ``rows`` (one token each)."""
        c = self.c
        context = c.num_computed[rows] + 1
        return self.policy.step_model.predict(int(len(rows)), int(context.sum()), int(context[c.is_hidden[rows]].sum()))

    def step_target(self, rows) -> float | None:
        """The seconds a step may take: ``tbt_headroom`` x the tightest TBT target among ``rows`` that
        can still pass (a request whose gaps so far leave its P99 no way under its target is not
        protected: it yields to those that can). None: nobody to protect."""
        c = self.c
        rows = np.asarray(rows, dtype=np.int64)
        live = rows[~c.missed[rows]] if rows.size else rows
        if not live.size:
            return None
        return self.policy.tbt_headroom * float(c.tbt_slo_ms[live].min()) / 1000.0
