"""Memory watermarks: steer the hidden-cache target and admission from the share of pages in use.

Above the light watermark the hidden target rises one step per observation (up to a cap); below it,
it falls one step per observation back to the operator's base ratio. Above the heavy watermark new
requests are not admitted until usage drops below it again. The same rule runs inside one engine and,
in the Ray Serve app, in the cluster-wide controller.

A noisy signal (a replica's usage swings by half its pages as requests come and go) would move the
ratio up and down every other observation; ``hysteresis`` and ``dwell`` damp the way down only: the
ratio falls once usage has stayed at or below ``light - hysteresis`` for ``dwell`` observations in a
row, and it still rises at once. Defaults (0, 1): the plain rule.
"""

from __future__ import annotations

from dataclasses import dataclass

# The one definition of the defaults (EngineConfig's fields, and through them the Serve app's arguments
# and its controller, take theirs from here).
LIGHT_WATERMARK = 0.7
HEAVY_WATERMARK = 0.9
MAX_HIDDEN_RATIO = 0.7
HIDDEN_RATIO_STEP = 0.1


@dataclass(frozen=True)
class WatermarkDecision:
    cache_ratio: float
    admit: bool
    changed: bool
    reason: str


class Watermarks:
    def __init__(self, light: float = LIGHT_WATERMARK, heavy: float = HEAVY_WATERMARK, cap: float = MAX_HIDDEN_RATIO,
                 step: float = HIDDEN_RATIO_STEP, base: float = 0.0, hysteresis: float = 0.0, dwell: int = 1):
        if not 0.0 <= light <= heavy <= 1.0:
            raise ValueError(f"light/heavy watermarks: need 0 <= light <= heavy <= 1, got {light}, {heavy}")
        if not 0.0 <= hysteresis <= light:
            raise ValueError(f"hysteresis: need 0 <= hysteresis <= light ({light}), got {hysteresis}")
        if dwell < 1:
            raise ValueError(f"dwell: need >= 1 observation, got {dwell}")
        self.light, self.heavy, self.cap, self.step = light, heavy, cap, step
        self.hysteresis, self.dwell = hysteresis, dwell
        self.low = round(light - hysteresis, 6)  # the ratio may fall at or below this
        self.base = min(base, cap) if cap >= base else base
        self.ratio = base
        self.admit = True
        self._quiet = 0  # observations in a row at or below light - hysteresis

    def observe(self, usage: float, admit_usage: float | None = None, rise_to: float = 0.0) -> WatermarkDecision:
        """One observation: ``usage`` moves the ratio and, unless ``admit_usage`` is given (the
        controller passes memory in use when ``usage`` carries a forecast), admission too. Over
        light, the ratio rises one step, or to ``rise_to`` at once where that is higher (the
        controller's forecast of a peak: it is seen coming, not felt step by step)."""
        ratio, admit, reasons = self.ratio, self.admit, []
        gate = usage if admit_usage is None else admit_usage
        self._quiet = self._quiet + 1 if usage <= self.low else 0
        if usage > self.light and self.ratio < self.cap:
            ratio = min(self.cap, max(round(self.ratio + self.step, 6), rise_to))
            reasons.append(f"usage {usage:.2f} > light {self.light}: hidden target {self.ratio:.2f} -> {ratio:.2f}")
        elif self._quiet >= self.dwell and self.ratio > self.base:
            ratio = max(self.base, round(self.ratio - self.step, 6))
            held = f" for {self._quiet} observations" if self.dwell > 1 else ""
            below = f"light {self.light}" + (f" - {self.hysteresis:g}" if self.hysteresis else "")
            reasons.append(f"usage {usage:.2f} <= {below}{held}: hidden target {self.ratio:.2f} -> {ratio:.2f}")
        if gate > self.heavy and self.admit:
            admit = False
            reasons.append(f"usage {gate:.2f} > heavy {self.heavy}: admission off")
        elif gate <= self.heavy and not self.admit:
            admit = True
            reasons.append(f"usage {gate:.2f} <= heavy {self.heavy}: admission on")
        changed = ratio != self.ratio or admit != self.admit
        self.ratio, self.admit = ratio, admit
        return WatermarkDecision(ratio, admit, changed, "; ".join(reasons))
