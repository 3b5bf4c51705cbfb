"""The value model (SPEC section 2), one definition for the adaptive policy and the router's admission.

Per request, with the operator's ``ValueWeights``::

    value   = time_weight * pending_s + slo_weight * urgency + priority_weight * importance
    density = value / pages ** memory_weight

``pending_s``: seconds since its last token (since arrival before the first); ``urgency`` in [0, 1]
rises as its next deadline approaches (``urgency``); ``importance``: how many priority levels it is
ahead of the least important request considered (``importance``). The terms keep their own units, so
each weight reads as seconds of waiting: urgency 1 is worth ``slo_weight`` seconds, one priority level
``priority_weight`` seconds. Importance is not normalised by the spread of priorities present (to
[0, 1]): measured on the simulator, a queue of 64 ShareGPT-like requests at priority 0 / 5 served the
important half later than the rest with it (mean TTFT ratio 1.61 at priority_weight 2) and as late at
5 (1.03); in levels, 0.67; and in a 30% / 70% priority 0 / 10 mix past capacity the important class
kept 0.43 attainment instead of 0.53. So one who wants a class far ahead gives it priorities far apart.
A request that has already missed its SLO keeps ``fairness_penalty`` of its time term and
``fairness_penalty`` as its urgency: it is served later, but its value never drops to zero. None
waits forever: one that has waited ``MAX_WAIT_S`` goes before every scored one (``max_wait_time`` of
``apt``, ``max_wait_s`` of the admission; one default for both).

With the weights (1, 1, 0, 0) the value is the paper's ``p_i`` and the density its value per page.
The defaults, (1, 1, 1.2, 2), are the seed's but for ``memory_weight`` (see ``ValueWeights``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

# Seconds after which a waiting request goes before every scored one: apt's ``max_wait_time`` and the
# router admission's ``max_wait_s`` (one bound on how long low-priority requests can be pushed back).
MAX_WAIT_S = 60.0
FAIRNESS_PENALTY = 0.1  # share of its value a request keeps once it has missed its SLO


@dataclass(frozen=True)
class ValueWeights:
    """The operator's knobs of the value model; each a finite number >= 0. The engine's ``apt`` and the
    router's admission default to these (``deployments.admission.ADMISSION_WEIGHTS`` is ``ValueWeights()``).

    The defaults, measured on the simulator (``SimulatedEngine``, the calibrated OPT-125m cost model of
    docs/benchmarks.md, 150 requests per rate; effective throughput at 90% / 60% attainment):

    - ``time_weight`` 1.0 (the seed's, the paper's): the unit the others are priced in, seconds waited.
    - ``memory_weight`` 1.0, not the seed's 0.8: favouring small requests less lost attainment on
      plain traces (ShareGPT-like 0.875 / 2.47 -> 0.778 / 2.28 req/s with the rest as before).
    - ``slo_weight`` 1.2 (the seed's; was 0): serving requests near their deadline first raised plain
      attainment (ShareGPT-like 0.875 / 2.47 -> 0.895 / 2.90 req/s; 0.653 -> 0.720 at 2 req/s).
    - ``priority_weight`` 2.0 (the seed's; was 0): one priority level is worth 2 s of waiting. A queue
      of 64 requests at priority 0 / 5, interleaved: mean TTFT of the important half / the rest
      2.49 -> 0.67 (4.0: 0.45, but the interactive class of a 30% / 70% mix at 1.5 req/s kept 0.43
      attainment instead of 0.53). Requests of one priority are untouched (importance 0).
    """

    time_weight: float = 1.0
    memory_weight: float = 1.0
    slo_weight: float = 1.2
    priority_weight: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            w = getattr(self, f.name)
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0:
                raise ValueError(f"{f.name}: must be a finite number >= 0, got {w!r}")
            object.__setattr__(self, f.name, float(w))

    @classmethod
    def of_policy(cls, options: dict | None) -> ValueWeights:
        """The weights among a policy's keyword arguments (``EngineConfig.policy_options``), the defaults
        for those not given: what the engine's ``apt`` prices with, for the router's admission to agree."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (options or {}).items() if k in names})

    def value(self, pending_s: np.ndarray, urgency: np.ndarray | None = None, importance: np.ndarray | None = None,
              *, missed: np.ndarray | None = None, fairness_penalty: float = 1.0) -> np.ndarray:
        """The value of each request. ``urgency`` / ``importance`` may be None where their weight is 0
        (the caller need not read deadlines or priorities then); ``missed`` marks requests that can no
        longer meet their SLO."""
        pending_s = _column("pending_s", pending_s, None)
        urgency = None if urgency is None else _column("urgency", urgency, pending_s.shape[0])
        importance = None if importance is None else _column("importance", importance, pending_s.shape[0])
        if missed is not None and np.shape(missed) != pending_s.shape:
            raise ValueError(f"missed: has shape {np.shape(missed)}, expected {pending_s.shape} (as pending_s)")
        if missed is None:
            value = self.time_weight * pending_s
        else:
            value = self.time_weight * np.where(missed, fairness_penalty * pending_s, pending_s)
        if self.slo_weight:
            if urgency is None:
                raise ValueError("urgency: needed when slo_weight > 0")
            term = urgency if missed is None else np.where(missed, fairness_penalty, urgency)
            value = value + self.slo_weight * term
        if self.priority_weight:
            if importance is None:
                raise ValueError("importance: needed when priority_weight > 0")
            value = value + self.priority_weight * importance
        return value

    def density(self, value: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Value per page ** memory_weight (a request needing no page counts as one)."""
        return density(value, pages, self.memory_weight)


def _column(name: str, x, n: int | None) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{name}: must be one number per request ({n if n is not None else 'a 1-D array'}), "
                         f"got shape {arr.shape}")
    if not (np.all(np.isfinite(arr)) and np.all(arr >= 0)):
        raise ValueError(f"{name}: must be finite numbers >= 0")
    return arr


def density(value: np.ndarray, pages: np.ndarray, memory_weight: float) -> np.ndarray:
    safe = np.maximum(pages, 1)
    return value / (safe if memory_weight == 1.0 else safe ** memory_weight)


def urgency(now: float, deadline, slack_s) -> np.ndarray:
    """How close each request is to its deadline, in [0, 1]: clip(1 - (deadline - now) / slack_s, 0, 1).

    0 while more than ``slack_s`` seconds remain, rising linearly to 1 at the deadline, and 1 after
    it (a missed request stays urgent; its value decay is ``fairness_penalty``'s job, not this one's).
    """
    d = np.asarray(deadline, dtype=np.float64)
    s = np.asarray(slack_s, dtype=np.float64)
    if np.any(~(s > 0)):
        raise ValueError(f"slack_s: must be > 0, got {slack_s!r}")
    return np.clip(1.0 - (d - float(now)) / s, 0.0, 1.0)


def importance(priority) -> np.ndarray:
    """Priority levels ahead of the least important request (vLLM convention: lower ``priority`` value
    = more important), so >= 0."""
    p = np.asarray(priority, dtype=np.float64)
    return p.max() - p if p.size else p
