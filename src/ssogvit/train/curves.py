"""Training curves of runs, read from their CSV logs (`<run>/logs/version_*/metrics.csv`) and drawn with matplotlib."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
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


def plot_training_curves(runs: Mapping[str, str | Path | Sequence[str | Path]], path: str | Path, *,
                         title: str | None = None, overwrite: bool = False,
                         row_of: Callable[[str], str] | None = None) -> Path | None:
    """One PNG with a panel per `CURVES` metric that some run logged and a line per label, epochs from 1.

    Args:
        runs: label -> a run folder, or several (seeds of one configuration): then the line is their mean at each
            epoch that every one of them logged, and a band spans the lowest to the highest run.
        path: the PNG to write.
        title: the figure's title.
        overwrite: replace `path` if it exists (otherwise an existing file is refused, `ssogvit.outputs`).
        row_of: label -> the row of panels its line goes in (e.g. a model family), each row its own legend beside
            it; None: one row.

    Returns:
        The path, or None when no run has a CSV log with these metrics to draw from (e.g. `logger=[]`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folders = {label: [f] if isinstance(f, (str, Path)) else list(f) for label, f in runs.items()}
    metrics = {label: [read_epoch_metrics(f) for f in group] for label, group in folders.items()}
    logged = [found for group in metrics.values() for found in group]
    curves = [(key, name) for key, name in CURVES  # a metric no run logged (no validation) gets no empty panel
              if any(math.isfinite(v) for found in logged for v in found.get(key, {}).values())]
    if not curves:
        return None
    rows: dict[str, list[str]] = {}
    for label in metrics:
        rows.setdefault(row_of(label) if row_of else "", []).append(label)
    fig, grid = plt.subplots(len(rows), len(curves), figsize=(4.6 * len(curves) + (2.2 if row_of else 0),
                                                              3.8 * len(rows)), constrained_layout=True, squeeze=False)
    for axes, (row, labels) in zip(grid, rows.items()):
        _plot_row(axes, curves, {label: metrics[label] for label in labels}, row)
        if row_of:
            axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
        else:
            axes[-1].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    from ssogvit.outputs import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # the one writer (ssogvit.outputs): a kill leaves the old file or nothing
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"), overwrite=overwrite)
    finally:
        plt.close(fig)
    return path


def _plot_row(axes, curves, metrics: Mapping[str, list[dict[str, dict[int, float]]]], row: str) -> None:
    """One panel per curve on `axes`: each label's mean over its runs, with a lowest-to-highest band."""
    from matplotlib.ticker import MaxNLocator

    for ax, (key, name) in zip(axes, curves):
        for label, group in metrics.items():
            series = [{e: v for e, v in found.get(key, {}).items() if math.isfinite(v)} for found in group]
            epochs = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not epochs:
                continue
            values = [[s[e] for s in series] for e in epochs]
            x = [e + 1 for e in epochs]
            line, = ax.plot(x, [sum(v) / len(v) for v in values], marker="o", markersize=3, label=label)
            if len(series) > 1:
                ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                                alpha=0.15, linewidth=0)
        ax.set_title(f"{row}: {name}" if row else name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
