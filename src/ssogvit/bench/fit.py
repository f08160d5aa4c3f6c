"""Power-law fits ``y ~ c * N^k`` (paper Table 3: operator memory against token count)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PowerLaw", "fit_power_law"]


@dataclass(frozen=True)
class PowerLaw:
    """``y = coef * n ** exponent``, fitted by least squares on ``log y = log coef + exponent * log n``."""

    exponent: float
    coef: float
    r2: float
    points: int

    def __call__(self, n: float) -> float:
        return self.coef * n**self.exponent


def fit_power_law(n: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """Fit ``y ~ coef * n^exponent`` to positive pairs (non-positive or missing ``y`` are dropped).

    Raises:
        ValueError: fewer than two usable points, or all ``n`` equal.
    """
    pairs = [(float(a), float(b)) for a, b in zip(n, y, strict=True) if a and b and a > 0 and b > 0]
    if len(pairs) < 2:
        raise ValueError(f"a power-law fit needs at least two positive points, got {len(pairs)}")
    xs = [math.log(a) for a, _ in pairs]
    ys = [math.log(b) for _, b in pairs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a power-law fit needs at least two distinct n")
    k = sum((x - mx) * (y_ - my) for x, y_ in zip(xs, ys, strict=True)) / sxx
    c = my - k * mx
    ss_res = sum((y_ - (c + k * x)) ** 2 for x, y_ in zip(xs, ys, strict=True))
    ss_tot = sum((y_ - my) ** 2 for y_ in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return PowerLaw(exponent=k, coef=math.exp(c), r2=r2, points=len(pairs))
