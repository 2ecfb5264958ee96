"""Open-loop arrival traces: when requests arrive, independent of how fast they are answered.

- `poisson`: exponential gaps at a constant rate.
- `bursty`: a two-state Markov-modulated Poisson process: calm periods (mean 2 s) at 0.5x and bursts (mean
  0.5 s) at 3x a base rate, scaled so the long-run mean is the requested rate.
- `maf`: Azure-Functions-like: the rate changes every minute of trace time, by lognormal multipliers
  (sigma 0.6, heavy-tailed like invocation counts of the Microsoft Azure Functions trace) on a slow sinusoidal
  trend, normalised to the requested mean; Poisson within each minute.

All are deterministic given (trace, n, rate, seed).
"""

from __future__ import annotations

import numpy as np

TRACES = ("poisson", "bursty", "maf")

BURST_FACTOR, CALM_FACTOR = 3.0, 0.5
BURST_MEAN_S, CALM_MEAN_S = 0.5, 2.0
MAF_MINUTE_S = 60.0
MAF_SIGMA = 0.6
MAF_TREND_PERIOD_MIN = 8.0


def _piecewise_poisson(n: int, boundaries_s: np.ndarray, rates_rps: np.ndarray, rng: np.random.Generator
                       ) -> np.ndarray:
    """n arrivals of a Poisson process whose rate is rates_rps[i] on [boundaries_s[i], boundaries_s[i+1])."""
    times: list[np.ndarray] = []
    total = 0
    for begin, end, rate in zip(boundaries_s[:-1], boundaries_s[1:], rates_rps):
        count = rng.poisson(rate * (end - begin))
        times.append(np.sort(rng.uniform(begin, end, count)))
        total += count
        if total >= n:
            break
    return np.concatenate(times)[:n] if times else np.zeros(0)


def arrival_times(trace: str, n: int, rate_rps: float, seed: int = 0) -> np.ndarray:
    """n sorted arrival times in milliseconds with a long-run mean rate of `rate_rps`."""
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; known: {', '.join(TRACES)}")
    if n < 0 or rate_rps <= 0:
        raise ValueError(f"need n >= 0 and a positive rate, got n={n}, rate={rate_rps}")
    rng = np.random.default_rng(seed)
    if n == 0:
        return np.zeros(0)
    if trace == "poisson":
        return np.cumsum(rng.exponential(1000.0 / rate_rps, n))
    # Enough periods to hold n arrivals with a wide margin; surplus periods are never sampled.
    span_s = 4.0 * n / rate_rps + 10 * MAF_MINUTE_S
    if trace == "bursty":
        calm_share = CALM_MEAN_S / (CALM_MEAN_S + BURST_MEAN_S)
        base = rate_rps / (calm_share * CALM_FACTOR + (1 - calm_share) * BURST_FACTOR)
        periods = int(span_s / (CALM_MEAN_S + BURST_MEAN_S)) + 1
        lengths = np.stack([rng.exponential(CALM_MEAN_S, periods), rng.exponential(BURST_MEAN_S, periods)], 1)
        rates = np.tile([CALM_FACTOR * base, BURST_FACTOR * base], periods)
        boundaries = np.concatenate([[0.0], np.cumsum(lengths.ravel())])
        return _piecewise_poisson(n, boundaries, rates, rng) * 1000.0
    minutes = int(span_s / MAF_MINUTE_S) + 1
    trend = 1.0 + 0.5 * np.sin(2 * np.pi * np.arange(minutes) / MAF_TREND_PERIOD_MIN)
    multipliers = trend * rng.lognormal(-MAF_SIGMA**2 / 2, MAF_SIGMA, minutes)
    # Normalise over the minutes the trace will actually span, so its mean rate is the requested one.
    expected_minutes = max(1, int(np.ceil(n / rate_rps / MAF_MINUTE_S)))
    rates = rate_rps * multipliers / multipliers[:expected_minutes].mean()
    boundaries = np.arange(minutes + 1) * MAF_MINUTE_S
    return _piecewise_poisson(n, boundaries, rates, rng) * 1000.0


def rate_over_time(arrivals_ms: np.ndarray, bin_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts in ms, requests per second in each bin)."""
    if not len(arrivals_ms):
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, arrivals_ms.max() + bin_ms, bin_ms)
    counts, _ = np.histogram(arrivals_ms, edges)
    return edges[:-1], counts / (bin_ms / 1000.0)
