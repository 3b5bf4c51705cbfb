"""Memory watermarks: steer the hidden-cache target and admission from the share of pages in use.

Above the light watermark the hidden target rises one step per observation (up to a cap); below it,
it falls one step per observation back to the operator's base ratio. Above the heavy watermark new
requests are not admitted until usage drops below it again. The same rule runs inside one engine and,
in the Ray Serve app, in the cluster-wide controller.
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
                 step: float = HIDDEN_RATIO_STEP, base: float = 0.0):
        if not 0.0 <= light <= heavy <= 1.0:
            raise ValueError(f"light/heavy watermarks: need 0 <= light <= heavy <= 1, got {light}, {heavy}")
        self.light, self.heavy, self.cap, self.step = light, heavy, cap, step
        self.base = min(base, cap) if cap >= base else base
        self.ratio = base
        self.admit = True

    def observe(self, usage: float) -> WatermarkDecision:
        ratio, admit, reasons = self.ratio, self.admit, []
        if usage > self.light and self.ratio < self.cap:
            ratio = min(self.cap, round(self.ratio + self.step, 6))
            reasons.append(f"usage {usage:.2f} > light {self.light}: hidden target {self.ratio:.2f} -> {ratio:.2f}")
        elif usage <= self.light and self.ratio > self.base:
            ratio = max(self.base, round(self.ratio - self.step, 6))
            reasons.append(f"usage {usage:.2f} <= light {self.light}: hidden target {self.ratio:.2f} -> {ratio:.2f}")
        if usage > self.heavy and self.admit:
            admit = False
            reasons.append(f"usage {usage:.2f} > heavy {self.heavy}: admission off")
        elif usage <= self.heavy and not self.admit:
            admit = True
            reasons.append(f"usage {usage:.2f} <= heavy {self.heavy}: admission on")
        changed = ratio != self.ratio or admit != self.admit
        self.ratio, self.admit = ratio, admit
        return WatermarkDecision(ratio, admit, changed, "; ".join(reasons))
