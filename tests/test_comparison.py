"""`ssogvit.train.comparison`: the one protocol of every printed comparison (intervals, paired gaps, verdicts,
plateau, learning speed), and `ssogvit report`'s tables built on it (models, gaps, sweep), from hand-made run logs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from ssogvit.train.comparison import (
    Gap, epochs_to, format_interval, interval, paired_gap, plateau_gain, reached_plateau,
)
from ssogvit.train.report import ReportError, RunLog, gaps_markdown, heads_markdown, models_markdown, sweep_markdown


def test_interval_is_students_t_over_the_seeds():
    values = [97.0, 98.0, 99.5]
    i = interval(values)
    # t(0.975, df=2) = 4.302652729911275 (tables); half-width = t * sd / sqrt(n)
    assert i.mean == pytest.approx(statistics.fmean(values))
    assert i.half == pytest.approx(4.302652729911275 * statistics.stdev(values) / math.sqrt(3), rel=1e-9)
    assert (i.low, i.high) == pytest.approx((i.mean - i.half, i.mean + i.half))
    five = interval([1.0, 2.0, 3.0, 4.0, 5.0])  # df=4: t = 2.7764451051977987
    assert five.half == pytest.approx(2.7764451051977987 * statistics.stdev([1, 2, 3, 4, 5]) / math.sqrt(5))


def test_one_seed_has_no_interval_and_says_so():
    i = interval([50.1])
    assert i.n == 1 and math.isnan(i.half)
    assert format_interval(i) == "50.10 (1 seed)"  # never "50.10 ± 0.00"
    assert format_interval(interval([1.0, 3.0]), signed=True) == "+2.00 ± 12.71"  # t(0.975, 1) * sd / sqrt(2)
    assert format_interval(interval([])) == "n/a"


def test_gaps_are_paired_by_seed_and_worded_by_their_interval():
    a = {0: 98.0, 1: 97.5, 2: 98.5, 7: 10.0}  # seed 7 has no partner: left out
    b = {0: 96.0, 1: 96.0, 2: 96.5}
    gap = paired_gap(a, b)
    assert gap.seeds == (0, 1, 2) and gap.per_seed == pytest.approx((2.0, 1.5, 2.0))
    assert gap.interval.mean == pytest.approx(11 / 6) and gap.verdict == "leads"
    assert paired_gap(b, a).verdict == "trails"
    noisy = paired_gap({0: 90.0, 1: 80.0, 2: 95.0}, {0: 85.0, 1: 88.0, 2: 86.0})
    assert noisy.interval.low < 0 < noisy.interval.high and noisy.verdict == "no clear difference"
    assert paired_gap({0: 2.0}, {0: 1.0}).verdict.startswith("no clear difference (one seed")
    # a consistent gap that a paired test sees and an unpaired comparison of the two means would not
    shifted = paired_gap({s: 80.0 + 5 * s + 0.5 for s in range(3)}, {s: 80.0 + 5 * s for s in range(3)})
    assert shifted.verdict == "leads"


def test_plateau_is_the_last_fifth_adding_under_half_a_point():
    rising = {e: float(e) for e in range(1, 11)}  # +1 per epoch
    assert plateau_gain(rising) == pytest.approx(2.0) and not reached_plateau(rising)
    flat = {**{e: 50.0 + e for e in range(1, 9)}, 9: 58.2, 10: 58.4}  # best 58 before, 58.4 in the last fifth
    assert plateau_gain(flat) == pytest.approx(0.4) and reached_plateau(flat)
    falling = {**{e: float(e) for e in range(1, 9)}, 9: 3.0, 10: 2.0}
    assert plateau_gain(falling) < 0 and reached_plateau(falling)
    assert math.isnan(plateau_gain({1: 1.0, 2: 2.0})) and not reached_plateau({1: 1.0, 2: 2.0})


def test_epochs_to_90_percent():
    assert epochs_to({1: 50.0, 2: 89.9, 3: 90.0, 4: 95.0}) == 3.0
    assert math.isnan(epochs_to({1: 50.0, 2: 80.0}))


def _run(mixer: str, head: str, seed: int, test: float, curve: list[float], *, lr: float = 5e-3,
         paper: float | None = None) -> RunLog:
    run = RunLog(path=Path(f"/runs/{mixer}/{head}/{seed}/{lr}"), name=f"digits8_vit_{mixer}", data="digits",
                 max_epochs=len(curve), rows=[], family="vit", mixer=mixer, head=head, seed=seed, paper_top1=paper,
                 settings={"optim.lr": lr, "model.kwargs.global_pool": head})
    run.series["val/top1"] = {e + 1: v for e, v in enumerate(curve)}
    run.test = {"test/top1": test}
    return run


CURVE = [40.0, 70.0, 91.0, 95.0, 96.0, 96.2, 96.3, 96.3, 96.4, 96.4]


def test_models_and_gaps_tables_follow_the_protocol():
    runs = [_run("ssog", "avg", s, 97.0 + s * 0.5, CURVE, paper=78.63) for s in range(3)]
    runs += [_run("mha", "token", s, 95.0 + s, [10.0] * 5 + [92.0] * 5, paper=74.67) for s in range(3)]
    text = models_markdown(runs)
    assert "| vit | avg | ssog | 97.50 ± 1.24 | 97.00, 97.50, 98.00 | optim.lr=0.005 model.kwargs.global_pool=avg " \
           "| 3/3 | 3.0 ± 0.0 |" in text
    assert "| vit | token | mha | 96.00 ± 2.48 |" in text and text.startswith("Each model's test top-1")
    gaps = gaps_markdown(runs)
    per_seed = [2.0, 1.5, 1.0]
    i = interval(per_seed)
    assert (f"| vit | own (avg vs token) | ssog - mha | **+1.50 ± {i.half:.2f}** | +2.00, +1.50, +1.00 | "
            f"ssog leads | +3.96 | +3.0 ± 0.0 |") in gaps


def test_heads_table_pairs_each_model_with_both_heads():
    runs = [_run("ssog", "avg", s, 97.0 + s, CURVE) for s in range(3)]
    runs += [_run("ssog", "token", s, 90.0 + 2 * s, [10.0] * 5 + [92.0] * 5) for s in range(3)]
    runs += [_run("mha", "token", s, 95.0, CURVE) for s in range(3)]  # one head only: no row
    text = heads_markdown(runs)
    i = interval([7.0, 6.0, 5.0])
    assert f"| vit | ssog | **+6.00 ± {i.half:.2f}** | +7.00, +6.00, +5.00 | avg leads | +3.0 ± 0.0 |" in text
    assert "| vit | mha |" not in text
    close = [_run("ssog", "avg", s, 97.0 + (-1) ** s, CURVE) for s in range(3)]
    close += [_run("ssog", "token", s, 97.0, CURVE) for s in range(3)]
    assert "| **+0.33 ± " in heads_markdown(close) and "no clear difference |" in heads_markdown(close)


def test_a_comparison_refuses_two_settings_of_one_model_and_the_sweep_chooses_on_validation():
    runs = [_run("ssog", "avg", 100, 99.9, [50.0] * 4 + [90.0], lr=2e-3),
            _run("ssog", "avg", 100, 10.0, [50.0] * 4 + [95.0], lr=5e-3)]
    with pytest.raises(ReportError, match="two runs of vit ssog .avg head. with seed 100"):
        models_markdown(runs)
    sweep = sweep_markdown(runs)
    assert "| digits8_vit_ssog | avg | optim.lr=0.005 | 95.00 (1 seed) | 100 | 0/1 | **chosen** |" in sweep
    assert "99.9" not in sweep  # the test split takes no part in the choice
    assert isinstance(paired_gap({}, {}), Gap)
