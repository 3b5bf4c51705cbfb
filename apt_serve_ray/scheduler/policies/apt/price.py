"""Stage 1 of the adaptive policy: price every candidate (``policy.py``'s docstring, stage 1).

``write_off`` first: requests whose first token cannot come in time are priced as already late
(``admission.predicted_late``), or shed where the deployment sheds. Then ``price``: the value model
with the operator's weights, and what evicting a running request would cost the requests that can
still pass.
"""

from __future__ import annotations

import numpy as np

from apt_serve_ray.scheduler.candidates import NEVER_FITS
from apt_serve_ray.scheduler.costs import recompute_seconds
from apt_serve_ray.scheduler.policies.apt.admission import predicted_late, reserved_row
from apt_serve_ray.scheduler.policies.apt.decision import Decision


def write_off(d: Decision) -> None:
    """Mark the requests ``predicted_late`` finds as missed (the reserved one, if any, leads the order,
    as it leads the admissions); with ``shed_late``, turn away those of them that hold nothing."""
    p, c = d.policy, d.c
    lead = reserved_row(c, np.zeros(c.num, dtype=bool), p.reserve_after, p.reserved)
    late = predicted_late(c, p.step_model, seconds_scale=prefill_scale(d),
                          chunk_tokens=d.ctx.config.max_num_batched_tokens, lead=lead,
                          fewest=p.write_off_fewest)
    c.missed[late] = True
    if p.shed_late:
        shed(d, late)


def shed(d: Decision, late: np.ndarray) -> None:
    """Turn away the waiting requests among ``late`` that hold nothing (``ctx.shed``); their rows
    stay in the table, fitting in no kind, so nothing below chooses them."""
    c = d.c
    rows = late[(late >= c.num_running) & (c.num_computed[late] == 0)]
    if c.copy is not None:
        rows = rows[c.copy[rows] < 0]
    for row in rows.tolist():
        d.ctx.shed(c.requests[row])
    c.mem[:, rows] = NEVER_FITS
    c.mem_held[rows] = NEVER_FITS


def prefill_scale(d: Decision) -> float:
    """Wall seconds one second of the model's prefill takes now: the measured slowdown, over the
    share of a step the decodes leave (steps are as long as the tightest live gap allows; taken
    as at least a tenth, so a step full of decodes still reads as slow prefill, not none)."""
    p, c = d.policy, d.c
    rows = np.flatnonzero(c.is_decoding[: c.num_running])
    target = d.step_target(rows)
    if target is None:
        return p.slowdown
    decode_s = d.decode_seconds(rows) * p.slowdown
    return p.slowdown / min(1.0, max(0.1, 1.0 - decode_s / target))


def eviction_seconds(d: Decision) -> np.ndarray:
    """Per running row, in the step-time model's seconds, what evicting it costs: its tokens computed
    again, or its pages out to the tier and back where the tier has room for them and that is cheaper."""
    c = d.c
    n_run = c.num_running
    evict_s = recompute_seconds(d.policy.step_model, c.num_computed[:n_run].astype(np.float64))
    transfer = getattr(getattr(d.cache, "swap", None), "transfer", None)
    if transfer is not None and d.free_swap_slots:
        swap_s = c.num_held[:n_run] * transfer.seconds(1)  # a round trip; linear in pages: one product
        evict_s = np.where(c.num_held[:n_run] <= d.free_swap_slots, np.minimum(evict_s, swap_s), evict_s)
    return evict_s


def price(d: Decision) -> None:
    """Each candidate's value (``d.value``), and ``U * m * hidden_cost_steps`` (``d.kind_weight``):
    times a kind's seconds per page, what choosing that kind for it costs (its value in kind k is
    ``value - d.per_page[k] * kind_weight``)."""
    p, c = d.policy, d.c
    value = p.weights.value(c.pending_s, c.urgency, c.importance, missed=c.missed,
                            fairness_penalty=p.fairness_penalty)
    u = int((~c.missed).sum())
    if c.num_running and p.step_model is not None:
        # Evicting a running request delays the U requests that can still pass by what it costs:
        # recomputing its tokens, or moving its pages out and back where the tier below memory
        # has room (and that is cheaper), priced like the hidden kind's recompute (U x time).
        value[:c.num_running] += u * eviction_seconds(d)
    d.value, d.kind_weight = value, (u * p.hidden_cost_steps) * c.mem_kv
