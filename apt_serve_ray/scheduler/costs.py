"""What a step costs, as the adaptive policy prices it: measured by whoever runs the model, injected.

The policy never measures anything itself. The engine times its model at start
(``calibration.measure_costs``) and hands the result to ``policy.set_costs``; the simulator's engine
hands it nothing (``calibrate_rho=False``), so a scenario gives the policy its cost model
(``AdaptiveScheduler(rho=..., step_model=...)`` or ``set_costs``); a test hands it numbers. Fields left
``None`` are unknown: rho then counts as 0 (the hidden kind is free), and without a step-time model
prefill chunks keep the fixed token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StepTimeModel(Protocol):
    """Predicted seconds of one step (``calibration.StepTimeModel``, the simulator's ``CostModel``)."""

    def predict(self, num_tokens: int, sum_context: int, sum_hidden_context: int = 0) -> float: ...


@dataclass(frozen=True)
class StepCosts:
    # rho: extra decode-step seconds of keeping one KV page's worth of context in the hidden kind.
    rho: float | None = None
    step_time: StepTimeModel | None = None

    def __post_init__(self) -> None:
        if self.rho is not None and (isinstance(self.rho, bool) or not self.rho >= 0):
            raise ValueError(f"rho: must be >= 0 seconds per page, got {self.rho!r}")
