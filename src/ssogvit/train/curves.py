"""Training curves of runs, read from their CSV logs (`<run>/logs/version_*/metrics.csv`) and drawn with matplotlib."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from pathlib import Path

__all__ = ["read_epoch_metrics", "plot_training_curves", "CURVES"]

# (metric in the CSV log, panel title): what `plot_training_curves` draws, one panel each
CURVES = (("train/loss_epoch", "training loss"), ("val/loss", "validation loss"), ("val/top1", "validation top-1 (%)"))


def read_epoch_metrics(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """`{metric: {epoch: value}}` from every CSV log version of a run; a later launch's row wins for its epoch."""
    out: dict[str, dict[int, float]] = {}
    paths = sorted(Path(run_dir).glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if not row.get("epoch"):
                    continue
                epoch = int(float(row["epoch"]))
                for key, value in row.items():
                    if key not in ("epoch", "step") and value not in (None, ""):
                        out.setdefault(key, {})[epoch] = float(value)
    return out


def plot_training_curves(runs: Mapping[str, str | Path], path: str | Path, *, title: str | None = None) -> Path | None:
    """One PNG with a panel per `CURVES` metric and a line per run (label -> run folder), epochs from 1.

    Returns the path, or None when no run has a CSV log to draw from (e.g. `logger=[]`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = {label: read_epoch_metrics(folder) for label, folder in runs.items()}
    if not any(metrics.values()):
        return None
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4), constrained_layout=True)
    for ax, (key, name) in zip(axes, CURVES):
        for label, found in metrics.items():
            points = sorted((e, v) for e, v in found.get(key, {}).items() if math.isfinite(v))
            if points:
                ax.plot([e + 1 for e, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    from ssogvit.outputs import atomic_write

    path = Path(path)
    try:  # the caller's own fresh folder (`ssogvit main`): the one writer, a kill leaves the old file or nothing
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"), overwrite=True)
    finally:
        plt.close(fig)
    return path
