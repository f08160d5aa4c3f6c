"""The one protocol by which ssogvit compares models (docs/training.md, "How comparisons are made").

Every accuracy comparison the project prints (`ssogvit main`, `ssogvit report`, docs/reproduction.md) goes through
these functions, so that they all say the same things in the same words:

- a model's figure is the mean over its seeds with a 95% confidence interval (Student's t over the seeds);
- a gap between two models is the **paired** mean difference over the seeds they share (seed s of one against seed s
  of the other: same initial draw of the data order and split), with its own 95% t interval and every seed's
  difference;
- the words: "leads" / "trails" only where the gap's interval excludes zero, "no clear difference" otherwise;
- a run has converged ("plateau") when its best validation top-1 over the last fifth of its epochs is less than
  `PLATEAU_POINTS` above its best before them; a run that has not is named as budget-limited;
- learning speed: the first epoch at which validation top-1 reaches `SPEED_TOP1` %.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MAY_DIFFER", "comparison_differences", "PLATEAU_FRACTION", "PLATEAU_POINTS", "SPEED_TOP1", "Interval",
           "Gap", "interval", "paired_gap",
           "plateau_gain", "reached_plateau", "epochs_to", "format_interval"]

PLATEAU_FRACTION = 0.2   # the last fifth of the epochs ...
PLATEAU_POINTS = 0.5     # ... adds less than half a point of validation top-1 to the best before it
SPEED_TOP1 = 90.0        # learning speed: epochs to this validation top-1 (%)
CONFIDENCE = 0.95
#: the run-config keys in which the runs of one comparison may differ (docs/training.md, "How comparisons are made"):
#: the mixer (its name and, by `comparison_differences`, its options), its head, its tuned settings, the seed, and the
#: run's name and notes; where things are and how they are shown (`run_folder.IGNORED_KEYS`) too. Anything else (the
#: data split, the budget, the width) would make a gap between different experiments.
MAY_DIFFER = ("seed", "name", "meta", "model.mixer", "model.name", "model.kwargs.global_pool", "model.kwargs.fc_norm",
              "optim.lr", "loss.jasmin.weight")


def _t_quantile(df: int) -> float:
    """The two-sided `CONFIDENCE` quantile of Student's t with `df` degrees of freedom (scipy)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and the half-width of its 95% t interval (nan for one value: no interval)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half


@dataclass(frozen=True)
class Gap:
    """The paired difference `a - b` over shared seeds: its interval, every seed's difference, and the verdict."""

    interval: Interval
    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]

    @property
    def verdict(self) -> str:
        """"leads" / "trails" where the 95% interval excludes zero; else "no clear difference" (also for one seed)."""
        i = self.interval
        if i.n < 2 or math.isnan(i.half):
            return "no clear difference (one seed: no interval)"
        if i.low > 0:
            return "leads"
        if i.high < 0:
            return "trails"
        return "no clear difference"


def interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval half-width of `values` (nan values dropped; one value: half-width nan)."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return Interval(math.nan, math.nan, 0)
    mean = statistics.fmean(kept)
    if len(kept) < 2:
        return Interval(mean, math.nan, 1)
    return Interval(mean, _t_quantile(len(kept) - 1) * statistics.stdev(kept) / math.sqrt(len(kept)), len(kept))


def paired_gap(a: Mapping[int, float], b: Mapping[int, float]) -> Gap:
    """`a - b` paired by seed over the seeds both have (`{seed: value}` each)."""
    seeds = tuple(sorted(set(a) & set(b)))
    diffs = tuple(float(a[s]) - float(b[s]) for s in seeds)
    return Gap(interval(diffs), seeds, diffs)


def format_interval(i: Interval, *, signed: bool = False, digits: int = 2) -> str:
    """`97.80 ± 0.60` (mean ± 95% half-width), or the mean alone with "(1 seed)" where there is no interval."""
    sign = "+" if signed else ""
    if math.isnan(i.mean):
        return "n/a"
    if i.n < 2:
        return f"{i.mean:{sign}.{digits}f} (1 seed)"
    return f"{i.mean:{sign}.{digits}f} ± {i.half:.{digits}f}"


def plateau_gain(series: Mapping[int, float], fraction: float = PLATEAU_FRACTION) -> float:
    """How far the best value of the last `fraction` of the epochs is above the best before them (points; <= 0 when
    the last epochs bring nothing new). `series` is `{epoch: value}`; nan for fewer than 5 epochs."""
    epochs = sorted(series)
    if len(epochs) < 5:
        return math.nan
    tail = max(1, int(round(fraction * len(epochs))))
    before, last = epochs[:-tail], epochs[-tail:]
    return max(series[e] for e in last) - max(series[e] for e in before)


def reached_plateau(series: Mapping[int, float]) -> bool:
    """The convergence criterion: the last fifth of the epochs adds less than `PLATEAU_POINTS` to the best."""
    gain = plateau_gain(series)
    return not math.isnan(gain) and gain < PLATEAU_POINTS


def epochs_to(series: Mapping[int, float], threshold: float = SPEED_TOP1) -> float:
    """The first epoch (counted from 1) at which `series` reaches `threshold`; nan if it never does."""
    return next((float(e) for e in sorted(series) if series[e] >= threshold), math.nan)


def comparison_differences(a: Mapping, b: Mapping, labels: tuple[str, str] = ("saved", "now")) -> list[str]:
    """`"key: <labels[0]> A, <labels[1]> B"` for each key in which two runs' configs `a` and `b` differ that the
    runs of one comparison must share (all but `MAY_DIFFER`, the mixers' options and `IGNORED_KEYS`)."""
    from ssogvit.layers import list_mixers, mixer_options

    from .run_folder import IGNORED_KEYS, config_diff

    options = sorted({f"model.kwargs.{o}" for m in list_mixers() for o in mixer_options(m)})
    return config_diff(a, b, ignored=(*MAY_DIFFER, *options, *IGNORED_KEYS), labels=labels)
