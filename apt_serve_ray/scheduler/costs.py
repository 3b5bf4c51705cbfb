"""What a step costs, as the adaptive policy prices it: measured by whoever runs the model, injected.

The policy never measures anything itself. The engine times its model at start
(``calibration.measure_costs``) and hands the result to ``policy.set_costs``; the simulator's engine
hands it nothing (``calibrate_rho=False``), so a scenario gives the policy its cost model
(``AdaptiveScheduler(rho=..., step_model=...)`` or ``set_costs``); a test hands it numbers. Fields left
``None`` are unknown: rho then counts as 0 (the hidden kind is free), and without a step-time model
prefill chunks keep the fixed token budget.

Every compressed kind costs decode time while a request holds it: the hidden kind recomputes K/V, the
int8 kinds dequantise. Each is one figure in one unit, seconds added to a decode step per KV page's
worth of context (16 tokens, the unit the scheduler counts ``m_i`` in) held in that kind: ``rho`` for
the hidden kind (its name since the paper), ``kind_costs`` for the others. A kind whose measurement
failed (the runner cannot run it) is in ``unavailable``: the adaptive policy never offers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

from apt_serve_ray.cache.kinds import CacheKind

# How each kind's extra step time is priced (its spec's ``cost``): kv is the reference; hidden by rho and
# the step-time model's hidden context; the others per page, as measured (``StepCosts.kind_costs``).
_BY_RHO = frozenset(k for k in CacheKind if k.spec.cost == "rho")


class StepTimeModel(Protocol):
    """Predicted seconds of one step (``calibration.StepTimeModel``, the simulator's ``CostModel``).

    ``num_tokens``: tokens computed; ``sum_context``: the rows' contexts after the step, summed;
    ``sum_hidden_context``: the same over rows holding the hidden kind; ``prefill_pairs``: the
    query-key pairs of the step's prefill chunks (``chunk_pairs``), the part of a chunk's attention
    that grows with where it starts: a 512-token chunk at position 1,000 took 1.75x one at position 0
    (OPT-125m, fp32, one thread), which a model linear in tokens and context cannot see."""

    def predict(self, num_tokens: int, sum_context: int, sum_hidden_context: int = 0,
                prefill_pairs: int = 0) -> float: ...


def chunk_pairs(start: int, num_tokens: int) -> int:
    """Query-key pairs of a prefill chunk's causal attention: query i (position ``start + i``) attends
    to keys ``0 .. start + i``. A decode row (one token) is not a chunk: its keys are its context."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2 if num_tokens > 1 else 0


def rows_features(rows) -> tuple[int, int, int, int]:
    """``(num_tokens, sum_context, sum_hidden_context, prefill_pairs)`` of a step of ``(start, tokens,
    hidden)`` rows, as ``predict`` takes them."""
    tokens = context = hidden_context = pairs = 0
    for start, n, hidden in rows:
        tokens += n
        context += start + n
        if hidden:
            hidden_context += start + n
        pairs += chunk_pairs(start, n)
    return tokens, context, hidden_context, pairs


def step_features(chunks) -> tuple[int, int, int, int]:
    """``rows_features`` of a step's ``ScheduledChunk``s (before the step: ``num_computed_tokens`` is where
    each chunk starts)."""
    return rows_features((c.request.num_computed_tokens, c.num_tokens, c.request.kind in _BY_RHO)
                         for c in chunks)


def recompute_seconds(model: StepTimeModel, num_tokens):
    """Predicted seconds to compute ``num_tokens`` tokens again from position 0 in one chunk (a number
    or an array: the model is linear in its features, so this is vectorised)."""
    base = model.predict(0, 0)
    per_token = max(model.predict(1, 1) - base, 1e-9)
    per_pair = max(model.predict(0, 0, 0, 1) - base, 0.0)
    return per_token * num_tokens + per_pair * num_tokens * (num_tokens + 1) / 2


def predict_step(model: StepTimeModel | None, chunks) -> float | None:
    """The model's seconds for a step of ``chunks`` (None without a model)."""
    return None if model is None else float(model.predict(*step_features(chunks)))


@dataclass(frozen=True)
class StepCosts:
    # rho: extra decode-step seconds of keeping one KV page's worth of context in the hidden kind.
    rho: float | None = None
    step_time: StepTimeModel | None = None
    # The same for the other compressed kinds (kv-int8, hidden-int8); a kind absent is unknown (0).
    # Given as a mapping (kind or its name -> seconds); kept as sorted (kind, seconds) pairs, hashable.
    kind_costs: Mapping | tuple = field(default=())
    unavailable: frozenset = frozenset()  # kinds the runner could not run at calibration: never offered
    # Seconds per token of changing a running request's kind in place (compressing to an int8 kind,
    # upgrading to KV: dequantising, or projecting K/V from x), per (from kind, to kind); what such a
    # change adds to the step it runs in. Given as a mapping or (pair, seconds) pairs; absent: unknown (0).
    conversion_costs: Mapping | tuple = field(default=())

    def __post_init__(self) -> None:
        if self.rho is not None and (isinstance(self.rho, bool) or not self.rho >= 0):
            raise ValueError(f"rho: must be >= 0 seconds per page, got {self.rho!r}")
        pairs = dict(self.kind_costs.items() if isinstance(self.kind_costs, Mapping) else self.kind_costs)
        costs = {}
        for kind, seconds in pairs.items():
            try:
                kind = CacheKind(kind)
            except ValueError:
                raise ValueError(f"kind_costs: unknown cache kind {kind!r}") from None
            if kind.spec.cost != "measured":
                raise ValueError(f"kind_costs: {kind.value} has no entry here (kv costs nothing; hidden's is rho)")
            if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and seconds >= 0):
                raise ValueError(f"kind_costs: {kind.value} must be >= 0 seconds per page, got {seconds!r}")
            costs[kind] = float(seconds)
        object.__setattr__(self, "kind_costs", tuple(sorted(costs.items(), key=lambda kv: kv[0].value)))
        try:
            object.__setattr__(self, "unavailable", frozenset(CacheKind(k) for k in self.unavailable))
        except ValueError:
            raise ValueError(f"unavailable: must hold cache kinds, got {self.unavailable!r}") from None
        conv = dict(self.conversion_costs.items() if isinstance(self.conversion_costs, Mapping)
                    else self.conversion_costs)
        checked = {}
        for pair, seconds in conv.items():
            try:
                a, b = (CacheKind(k) for k in pair)
            except (TypeError, ValueError):
                raise ValueError(f"conversion_costs: keys must be (from kind, to kind), got {pair!r}") from None
            if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and seconds >= 0):
                raise ValueError(f"conversion_costs: {a.value} -> {b.value} must be >= 0 seconds per token, "
                                 f"got {seconds!r}")
            checked[(a, b)] = float(seconds)
        object.__setattr__(self, "conversion_costs",
                           tuple(sorted(checked.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))))

    def known(self, kind: CacheKind) -> bool:
        """Whether ``kind``'s per-step cost was given or measured."""
        if kind in _BY_RHO:
            return self.rho is not None
        return kind.spec.cost == "none" or any(k is kind for k, _ in self.kind_costs)

    def conversion_seconds(self, from_kind: CacheKind, to_kind: CacheKind, num_tokens: int) -> float:
        """What converting ``num_tokens`` tokens in place from one kind to another adds to a step (0:
        unknown)."""
        for pair, seconds in self.conversion_costs:
            if pair == (from_kind, to_kind):
                return seconds * num_tokens
        return 0.0

    def seconds_per_page(self, kind: CacheKind) -> float:
        """Extra decode-step seconds per KV page's worth of context held in ``kind`` (unknown: 0)."""
        if kind in _BY_RHO:
            return self.rho or 0.0
        return dict(self.kind_costs).get(kind, 0.0)
