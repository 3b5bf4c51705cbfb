"""TrafficPredictor: the arrivals of the next seconds, from those of the last ``history_window`` seconds.

What it sees: arrivals in wall time (``observe``: a count and the tokens they bring, prompt and
output). What it keeps: per-second bins (``bin_s``) of the last ``history_window`` seconds. What it
says (``forecast(horizon_s)``): the mean arrival rate and token demand over the next ``horizon_s``
seconds, each with a band, and the highest per-bin rate it expects on the way (a peak).

The model is exponential smoothing, written here in numpy (statsmodels would bring a large
dependency for three recursions, and its fit is slower than a grid on 300 points)::

    level_t  = a (y_t - s_{t-m}) + (1 - a)(level_{t-1} + phi trend_{t-1})
    trend_t  = b (level_t - level_{t-1}) + (1 - b) phi trend_{t-1}
    s_t      = g (y_t - level_t) + (1 - g) s_{t-m}          (Holt-Winters, additive; Holt: s = 0)
    y_{t+h}  = level_t + (phi + ... + phi^h) trend_t + s_{t+h-m}

``y`` is arrivals per bin. The season ``m`` is configured (``season_s``) or detected: the shortest lag
whose autocorrelation (of the series less its linear trend) is within 10% of the highest and over
``MIN_SEASON_ACF``, once the history holds two periods. The parameters (a, b, g, phi) are chosen by
one-step squared error over a small grid, all grid points run at once as numpy columns, and refit
only when a new bin completes. The band is empirical: the ``band`` central quantiles of the model's
own in-sample errors at that horizon (the mean of the next h bins against what came), so it is as
wide as the model has actually been wrong. Token demand is the arrival forecast times the tokens per
request over the history (demand per request moves slower than arrivals, and one fit is cheaper).

Not thread-safe: one owner observes and forecasts (an engine's loop, a controller's loop).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np

MIN_HISTORY_BINS = 8  # below this, the forecast is the mean so far ("mean")
MIN_SEASON_ACF = 0.3  # weaker periodicity is left to the level and trend
MIN_SEASON_BINS = 4
SEASON_CONTRAST = 0.5
# The grid the smoothing parameters are chosen from (alpha, beta, gamma, phi).
_ALPHAS = (0.05, 0.1, 0.2, 0.4, 0.7)
_BETAS = (0.02, 0.1, 0.3)
_GAMMAS = (0.1, 0.3)
_PHIS = (0.9, 1.0)


@dataclass(frozen=True)
class Forecast:
    """Arrivals expected over ``[time, time + horizon_s)``: rates are means over the horizon with the
    ``band`` interval around them; ``peak_arrival_rate`` the highest per-bin rate on the way."""

    time: float
    horizon_s: float
    arrival_rate: float  # requests / s
    arrival_rate_low: float
    arrival_rate_high: float
    token_rate: float  # (prompt + output) tokens / s
    token_rate_low: float
    token_rate_high: float
    peak_arrival_rate: float
    recent_arrival_rate: float  # observed over the last horizon_s (what today's memory already holds)
    recent_token_rate: float
    model: str  # "mean" (little history), "holt", or "holt-winters/<season>s"
    num_history_s: float

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


class TrafficPredictor:
    def __init__(self, history_window: float = 300, *, bin_s: float = 1.0, season_s: float | None = None,
                 band: float = 0.8) -> None:
        if not (isinstance(history_window, (int, float)) and history_window > 0 and math.isfinite(history_window)):
            raise ValueError(f"history_window: must be a finite number of seconds > 0, got {history_window!r}")
        if not (isinstance(bin_s, (int, float)) and 0 < bin_s <= history_window):
            raise ValueError(f"bin_s: must be in (0, history_window] seconds, got {bin_s!r}")
        if season_s is not None and not (isinstance(season_s, (int, float)) and
                                         MIN_SEASON_BINS * bin_s <= season_s <= history_window / 2):
            raise ValueError(f"season_s: must be None (detect) or in [{MIN_SEASON_BINS * bin_s:g}, "
                             f"history_window / 2] seconds, got {season_s!r}")
        if not 0.0 < band < 1.0:
            raise ValueError(f"band: must be in (0, 1), got {band!r}")
        self.history_window, self.bin_s, self.season_s, self.band = float(history_window), float(bin_s), season_s, band
        self.num_bins = max(1, int(round(history_window / bin_s)))
        self._arrivals = np.zeros(self.num_bins)
        self._tokens = np.zeros(self.num_bins)
        self._first_bin: int | None = None  # bins before the first observation are not history
        self._last_bin: int | None = None
        self._fit: _Fit | None = None
        self._fit_key: tuple | None = None
        self.num_observed = 0

    # Learning -------------------------------------------------------------------------------------
    def observe(self, now: float, arrivals: int = 1, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """``arrivals`` requests arrived at ``now`` (seconds on any steady clock) bringing these tokens;
        ``arrivals=0`` only marks time (so quiet seconds count as quiet)."""
        if not math.isfinite(now):
            raise ValueError(f"now: must be a finite time in seconds, got {now!r}")
        for name, value in (("arrivals", arrivals), ("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value!r}")
        b = self._bin(now)
        if self._last_bin is None:
            self._first_bin = self._last_bin = b
        if b > self._last_bin:
            for stale in range(self._last_bin + 1, min(b, self._last_bin + self.num_bins) + 1):
                self._arrivals[stale % self.num_bins] = self._tokens[stale % self.num_bins] = 0.0
            self._last_bin = b
        elif b <= self._last_bin - self.num_bins:
            return  # older than the window
        self._arrivals[b % self.num_bins] += arrivals
        self._tokens[b % self.num_bins] += prompt_tokens + output_tokens
        self.num_observed += arrivals

    def observe_request(self, now: float, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.observe(now, 1, prompt_tokens, output_tokens)

    # Forecasting ----------------------------------------------------------------------------------
    def forecast(self, horizon_s: float, now: float | None = None) -> Forecast:
        """The next ``horizon_s`` seconds from ``now`` (default: the end of the last observation's bin). Uses the
        bins completed before ``now``; the bin in progress is partial and would read as a dip."""
        if not (horizon_s > 0 and math.isfinite(horizon_s)):
            raise ValueError(f"horizon_s: must be a finite number of seconds > 0, got {horizon_s!r}")
        if now is None:
            now = (self._last_bin + 1) * self.bin_s if self._last_bin is not None else 0.0
        if not math.isfinite(now):
            raise ValueError(f"now: must be a finite time in seconds, got {now!r}")
        y, tokens = self.history(now)
        h = max(1, int(round(horizon_s / self.bin_s)))
        per_request = float(tokens.sum() / y.sum()) if y.sum() > 0 else 0.0
        recent = y[-h:].sum() / (min(h, len(y)) * self.bin_s) if len(y) else 0.0
        recent_tokens = tokens[-h:].sum() / (min(h, len(y)) * self.bin_s) if len(y) else 0.0
        if len(y) < MIN_HISTORY_BINS:
            mean = float(y.mean()) if len(y) else 0.0
            spread = float(y.std()) / math.sqrt(h) * 1.5 if len(y) > 1 else mean
            path, low, high, model = np.full(h, mean), max(0.0, mean - spread), mean + spread, "mean"
        else:
            fit = self._fitted(y, now)
            path = fit.path(h)
            err = fit.errors(y, h)
            mean = float(path.mean())
            if len(err) >= 10:
                q = np.quantile(err, [(1 - self.band) / 2, (1 + self.band) / 2])
            else:  # too few h-step errors: the one-step spread, shrunk as a mean of h bins
                z = statistics.NormalDist().inv_cdf((1 + self.band) / 2)
                q = np.array([-1.0, 1.0]) * z * fit.sigma / math.sqrt(h)
            low, high, model = max(0.0, mean + q[0]), max(0.0, mean + q[1]), fit.name
        path = np.maximum(path, 0.0)
        to_rate = 1.0 / self.bin_s
        rate, low, high = max(0.0, float(path.mean())) * to_rate, float(low) * to_rate, float(high) * to_rate
        high = max(high, rate)
        low = min(low, rate)
        return Forecast(time=float(now), horizon_s=float(horizon_s), arrival_rate=rate, arrival_rate_low=low,
                        arrival_rate_high=high, token_rate=rate * per_request, token_rate_low=low * per_request,
                        token_rate_high=high * per_request, peak_arrival_rate=float(path.max()) * to_rate,
                        recent_arrival_rate=float(recent), recent_token_rate=float(recent_tokens),
                        model=model, num_history_s=len(y) * self.bin_s)

    def history(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(arrivals, tokens) per completed bin before ``now``, oldest first, within the window."""
        if self._last_bin is None:
            return np.zeros(0), np.zeros(0)
        end = self._bin(now)  # the bin in progress: excluded
        start = max(self._first_bin, end - self.num_bins, self._last_bin - self.num_bins + 1)
        if end <= start:
            return np.zeros(0), np.zeros(0)
        idx = np.arange(start, end)
        live = idx <= self._last_bin  # bins after the last observation: nothing came
        arrivals = np.where(live, self._arrivals[idx % self.num_bins], 0.0)
        tokens = np.where(live, self._tokens[idx % self.num_bins], 0.0)
        return arrivals, tokens

    def season_bins(self, y: np.ndarray) -> int | None:
        """The season in bins: configured, or detected in ``y`` (None: no clear period)."""
        if self.season_s is not None:
            m = int(round(self.season_s / self.bin_s))
            return m if len(y) >= 2 * m else None
        return detect_season(y)

    def _bin(self, t: float) -> int:
        return int(math.floor(t / self.bin_s + 1e-9))

    def _fitted(self, y: np.ndarray, now: float) -> _Fit:
        key = (self._bin(now), len(y), float(y.sum()))  # a late count into a closed bin changes the sum
        if self._fit is None or key != self._fit_key:
            m = self.season_bins(y)
            # A detected period is an integer lag read off noisy correlations: its neighbours are fitted
            # too and the one that predicts best (one step ahead) is kept.
            tries = [m] if m is None or self.season_s is not None else [k for k in range(m - 3, m + 4)
                                                                        if MIN_SEASON_BINS <= k <= len(y) // 2]
            fits = [_Fit.choose(y, k, self.bin_s) for k in tries]
            self._fit, self._fit_key = min(fits, key=lambda f: f.sigma), key
        return self._fit


def detect_season(y: np.ndarray, min_lag: int = MIN_SEASON_BINS) -> int | None:
    """The shortest lag (of two periods at least in ``y``) whose autocorrelation is over
    ``MIN_SEASON_ACF`` and within 10% of the highest: the period, not one of its multiples."""
    n = len(y)
    if n < 2 * min_lag + 2:
        return None
    t = np.arange(n)
    resid = y - np.polyval(np.polyfit(t, y, 1), t)
    var = float(resid @ resid)
    if var <= 1e-12:
        return None
    lags = np.arange(1, n // 2 + 1)
    acf = np.array([float(resid[:-k] @ resid[k:]) / var * n / (n - k) for k in lags])
    # A period m has a trough near m/2 (the wave's other half); a trend or a step left in the residual
    # only decays with the lag. So: a local maximum over MIN_SEASON_ACF, standing SEASON_CONTRAST above
    # the correlation at half its lag.
    peaks = [m for m in range(min_lag, len(acf) + 1)
             if acf[m - 1] >= acf[m - 2] and (m == len(acf) or acf[m - 1] >= acf[m])
             and acf[m - 1] > MIN_SEASON_ACF and acf[m - 1] - acf[m // 2 - 1] > SEASON_CONTRAST]
    if not peaks:
        return None
    best = max(acf[m - 1] for m in peaks)
    return min(m for m in peaks if acf[m - 1] >= 0.9 * best)


@dataclass
class _Fit:
    """One chosen parameter set and its states over the history (for the path and the in-sample errors)."""

    name: str
    phi: float
    season: int  # 0: none
    level: np.ndarray  # per bin, after observing it
    trend: np.ndarray
    seasonal: np.ndarray  # s_t per bin (zeros without a season)
    sigma: float  # one-step error std

    @classmethod
    def choose(cls, y: np.ndarray, m: int | None, bin_s: float) -> _Fit:
        m = m or 0
        grid = np.array([(a, b, g, p) for a in _ALPHAS for b in _BETAS for g in (_GAMMAS if m else (0.0,))
                         for p in _PHIS])
        a, b, g, p = (grid[:, i] for i in range(4))
        n, k = len(y), len(grid)
        level, trend, seas = np.zeros((n, k)), np.zeros((n, k)), np.zeros((n + max(m, 1), k))
        start = m if m else 1
        if m:  # the season starts as the mean shape of every whole period seen (one period is noisy)
            first = y[:m].mean()
            level[m - 1] = first
            trend[m - 1] = (y[m:2 * m].mean() - first) / m if n >= 2 * m else 0.0
            periods = y[: n // m * m].reshape(-1, m)
            seas[:m] = (periods - periods.mean(axis=1, keepdims=True)).mean(axis=0)[:, None]
        else:  # the trend starts as the slope of the first bins, so a small beta need not find it
            first = y[: min(n, 20)]
            trend[0] = np.polyfit(np.arange(len(first)), first, 1)[0] if len(first) > 2 else 0.0
            level[0] = first.mean() - trend[0] * (len(first) - 1) / 2
        sse = np.zeros(k)
        for t in range(start, n):
            s_prev = seas[t - m] if m else 0.0
            pred = level[t - 1] + p * trend[t - 1] + s_prev
            sse += (y[t] - pred) ** 2
            level[t] = a * (y[t] - s_prev) + (1 - a) * (level[t - 1] + p * trend[t - 1])
            trend[t] = b * (level[t] - level[t - 1]) + (1 - b) * p * trend[t - 1]
            if m:
                seas[t] = g * (y[t] - level[t]) + (1 - g) * s_prev
        best = int(np.argmin(sse))
        name = f"holt-winters/{m * bin_s:g}s" if m else "holt"
        sigma = math.sqrt(sse[best] / max(1, n - start))
        return cls(name, float(p[best]), m, level[:, best].copy(), trend[:, best].copy(),
                   seas[:n, best].copy(), sigma)

    def _damp(self, h: int) -> np.ndarray:
        """phi + phi^2 + ... + phi^j for j = 1..h."""
        return np.cumsum(self.phi ** np.arange(1, h + 1))

    def _seasonal_ahead(self, t: int, h: int) -> np.ndarray:
        """s for bins t+1..t+h, from the last season observed at or before t."""
        if not self.season:
            return np.zeros(h)
        j = np.arange(1, h + 1)
        return self.seasonal[t - self.season + 1 + (j - 1) % self.season]

    def path(self, h: int) -> np.ndarray:
        """Arrivals per bin for the next h bins after the last one."""
        t = len(self.level) - 1
        return self.level[t] + self._damp(h) * self.trend[t] + self._seasonal_ahead(t, h)

    def errors(self, y: np.ndarray, h: int) -> np.ndarray:
        """In-sample errors of the h-bin mean forecast: what came minus what it would have said."""
        start = max(2 * self.season, 4)
        ts = np.arange(start, len(y) - h)
        if len(ts) == 0:
            return np.zeros(0)
        damp = self._damp(h).mean()
        predicted = np.array([self.level[t] + damp * self.trend[t] + self._seasonal_ahead(t, h).mean() for t in ts])
        window = np.cumsum(np.concatenate([[0.0], y]))
        actual = (window[ts + h + 1] - window[ts + 1]) / h
        return actual - np.maximum(predicted, 0.0)


def mape(forecast: np.ndarray, actual: np.ndarray) -> float:
    """Mean absolute percentage error over the points where something arrived (a zero actual has no
    percentage); nan when there are none."""
    forecast, actual = np.asarray(forecast, float), np.asarray(actual, float)
    keep = actual > 0
    return float(np.mean(np.abs(forecast[keep] - actual[keep]) / actual[keep])) if keep.any() else float("nan")
