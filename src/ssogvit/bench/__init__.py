"""Efficiency benchmarks (docs/benchmarks.md): analytic FLOPs, points each in a process of its own, fits and plots;
the command line is ``ssogvit bench models|operator|flops|check|report`` (``ssogvit.bench.cli``)."""

from ssogvit.bench.flops import count_flops, flops_breakdown, measure_flops, mixer_flops
from ssogvit.bench.runner import read_results, run_point, run_sweep, write_results
from ssogvit.bench.sweeps import PowerLaw, fit_power_law

__all__ = ["PowerLaw", "count_flops", "fit_power_law", "flops_breakdown", "measure_flops", "mixer_flops",
           "read_results", "run_point", "run_sweep", "write_results"]
