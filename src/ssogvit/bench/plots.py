"""PNG figures in the paper's form: relative and absolute model curves, operator fits (``None``: nothing to draw)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ssogvit.bench.sweeps import BASELINE_NAMES, model_table, operator_fits
from ssogvit.outputs import atomic_write
from ssogvit.results import pyplot

__all__ = ["plot_models", "plot_operator", "plot_relative"]

_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _style(i: int, j: int = 0) -> dict:
    return dict(marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[j % len(_STYLES)], color=f"C{i}")


def _finish(fig, axes, path: str | Path, fontsize: int) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # a time-only run (--no-memory) draws no memory lines
            ax.legend(fontsize=fontsize)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110), overwrite=True)
    pyplot().close(fig)
    return Path(path)


def plot_relative(rows: Sequence[dict], path: str | Path, baseline: str = "mha") -> Path | None:
    """Throughput relative to the baseline and memory saved (%) against resolution: one line per family, mixer and
    baseline (``model_table``: the ODE family's paper baseline first), line style per batch size."""
    table = [r for r in model_table(rows, baseline) if r.get("mixer") != r["baseline"] and "speedup" in r]
    if not table:
        return None
    fig, (ax_t, ax_m) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({r["batch"] for r in table})
    for i, key in enumerate(dict.fromkeys((r["family"], r["size"], r["mixer"], r["baseline"]) for r in table)):
        for j, b in enumerate(batches):
            pts = sorted((r["res"], r["speedup"], r.get("memory_saved")) for r in table
                         if (r["family"], r["size"], r["mixer"], r["baseline"]) == key and r["batch"] == b)
            if pts:
                label = f"{key[0]}-{key[1]} {key[2]} vs {key[3]}" + (f", batch {b}" if len(batches) > 1 else "")
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **_style(i, j))
                mem = [(p[0], 100 * p[2]) for p in pts if p[2] is not None]
                if mem:
                    ax_m.plot([p[0] for p in mem], [p[1] for p in mem], label=label, **_style(i, j))
    ax_t.axhline(1.0, color="grey", lw=0.8)
    ax_m.axhline(0.0, color="grey", lw=0.8)
    ax_t.set(xlabel="resolution (px)", ylabel="throughput / baseline throughput", title="Relative throughput")
    ax_m.set(xlabel="resolution (px)", ylabel="memory saved (%)", title="Peak memory saved against the baseline")
    return _finish(fig, (ax_t, ax_m), path, 8)


def plot_models(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Throughput (top) and peak memory (bottom) against resolution, one column per family, one line per mixer and
    batch size."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    families = sorted({(r["family"], r["size"]) for r in ok})
    fig, axes = pyplot().subplots(2, len(families), figsize=(4.6 * len(families), 7), squeeze=False)
    mixers, batches = sorted({r["mixer"] for r in ok}), sorted({r["batch"] for r in ok})
    for c, fam in enumerate(families):
        for i, mixer in enumerate(mixers):
            for j, b in enumerate(batches):
                pts = sorted((r["res"], r.get("images_per_s"), r.get("peak_mib")) for r in ok
                             if (r["family"], r["size"]) == fam and r["mixer"] == mixer and r["batch"] == b)
                for ax, k in ((axes[0][c], 1), (axes[1][c], 2)):
                    drawn = [p for p in pts if p[k] is not None]
                    if drawn:
                        ax.plot([p[0] for p in drawn], [p[k] for p in drawn],
                                label=f"{BASELINE_NAMES.get(mixer, mixer)}, batch {b}", **_style(i, j))
        axes[0][c].set(title=f"{fam[0]}-{fam[1]}", xlabel="resolution (px)", ylabel="throughput (images/s)",
                       yscale="log")
        axes[1][c].set(xlabel="resolution (px)", ylabel="peak memory (MiB)", yscale="log")
    return _finish(fig, [ax for col in axes for ax in col], path, 7)


def plot_operator(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Operator peak memory (left) and time (right) against tokens, log-log, with the fitted ``N^k`` lines and their
    exponents in the legend."""
    from matplotlib.ticker import NullFormatter

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4.4))
    ticks = sorted({r["tokens"] for r in ok})
    for ax, metric, ylabel, title in (
        (axes[0], "peak_mib", "peak memory (MiB)", "Operator peak memory, fit memory ~ N^k"),
        (axes[1], "time_ms", "time (ms)", "Operator time, fit time ~ N^k"),
    ):
        fits = operator_fits(ok, metric)
        for i, key in enumerate(sorted({(r["label"], r["batch"]) for r in ok}, key=lambda k: (k[1], k[0]))):
            pts = sorted((r["tokens"], r[metric]) for r in ok if (r["label"], r["batch"]) == key and r.get(metric))
            if pts:
                fit = fits.get(key)
                label = f"{key[0]} (batch {key[1]})" + (f": k = {fit.exponent:.2f}" if fit else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], _MARKERS[i % len(_MARKERS)], color=f"C{i}",
                        label=label)
                if fit:
                    ax.plot([pts[0][0], pts[-1][0]], [fit(pts[0][0]), fit(pts[-1][0])], "-", color=f"C{i}", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="tokens N (class token included)", ylabel=ylabel, title=title)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    return _finish(fig, axes, path, 8)
