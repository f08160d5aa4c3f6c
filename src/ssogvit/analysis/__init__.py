"""Look inside a model: Gaussian fields, effective atoms, Lipschitz bounds, attention sinks, steering, transfer.

Each analysis is a function here and a command, `ssogvit analyze <what>` (see `ssogvit.analysis.cli`).
"""

from .atoms import atoms_report, effective_atoms, plot_atoms
from .cli import ANALYSES, analyze
from .fields import atom_geometry, plot_fields, plot_query_fields, query_field_maps
from .lipschitz import (
    head_norm_bounds,
    jacobian_spectral_norm,
    lipschitz_bound,
    lipschitz_estimate,
    lipschitz_report,
    local_lipschitz_growth,
    plot_lipschitz,
)
from .sinks import (
    cls_mass,
    high_norm_share,
    most_attended_key,
    per_image_sink_stats,
    plot_sinks,
    rollout,
    same_key_share,
    sink_metrics,
    sink_report,
    sink_score,
    summarize_sink_stats,
)
from .steering import plot_steering, steering_stats
from .transfer import accuracy, plot_transfer, transfer_table, transferred

__all__ = [
    "ANALYSES", "analyze",
    "effective_atoms", "atoms_report", "plot_atoms",
    "atom_geometry", "plot_fields", "query_field_maps", "plot_query_fields",
    "head_norm_bounds", "lipschitz_bound", "lipschitz_estimate", "jacobian_spectral_norm",
    "local_lipschitz_growth", "lipschitz_report", "plot_lipschitz",
    "sink_score", "rollout", "most_attended_key", "same_key_share", "cls_mass", "high_norm_share",
    "per_image_sink_stats", "summarize_sink_stats", "sink_metrics", "sink_report", "plot_sinks",
    "steering_stats", "plot_steering",
    "accuracy", "transferred", "transfer_table", "plot_transfer",
]
