"""Efficiency benchmarks (docs/benchmarks.md): analytic FLOPs, per-point subprocess sweeps, power-law fits, plots.

``count_flops(model, img_size)`` is the analytic forward FLOP count per image; ``flops_breakdown`` splits it (its
``"mixer"`` entry is attention alone). ``run_sweep`` runs benchmark points each in its own process (``multiprocessing``,
timed with ``torch.utils.benchmark.Timer``). The command line is ``ssogvit bench models|operator|flops|check|report``
(``ssogvit.bench.cli``).
"""

from ssogvit.bench.fit import PowerLaw, fit_power_law
from ssogvit.bench.flops import count_flops, flops_breakdown, measure_flops, mixer_flops
from ssogvit.bench.runner import read_results, run_point, run_sweep, write_results

__all__ = [
    "count_flops",
    "flops_breakdown",
    "mixer_flops",
    "measure_flops",
    "fit_power_law",
    "PowerLaw",
    "run_point",
    "run_sweep",
    "read_results",
    "write_results",
]
