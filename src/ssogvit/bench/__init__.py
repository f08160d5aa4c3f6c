"""Efficiency benchmarks (docs/benchmarks.md): analytic FLOPs, sweeps of points each in its own process, power-law
fits, plots; the command line is ``ssogvit bench models|operator|flops|check|report`` (``ssogvit.bench.cli``).

``count_flops(model, img_size)`` is the analytic forward FLOP count per image and ``flops_breakdown`` splits it (its
``"mixer"`` entry is attention alone); ``run_sweep`` runs points (``ssogvit.bench.point``) each in a process of its
own, timed with ``torch.utils.benchmark.Timer``.
"""

from ssogvit.bench.flops import count_flops, flops_breakdown, measure_flops, mixer_flops
from ssogvit.bench.runner import read_results, run_point, run_sweep, write_results
from ssogvit.bench.sweeps import PowerLaw, fit_power_law

__all__ = ["PowerLaw", "count_flops", "fit_power_law", "flops_breakdown", "measure_flops", "mixer_flops",
           "read_results", "run_point", "run_sweep", "write_results"]
