"""PNG figures in the paper's form (matplotlib, Agg backend): relative and absolute model curves, operator fits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_relative", "plot_models", "plot_operator"]

_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ok(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def plot_relative(rows: Sequence[dict], path: str | Path, baseline: str = "mha") -> Path | None:
    """Relative throughput (x the baseline mixer's) and memory saved (%) against resolution, one line per family,
    mixer and baseline (`model_table`; the ODE family's paper-faithful `mha-unfused` baseline first), line style:
    batch size."""
    from ssogvit.bench.model_sweep import model_table

    table = [r for r in model_table(rows, baseline) if r.get("mixer") != r["baseline"] and "speedup" in r]
    if not table:
        return None
    plt = _plt()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = list(dict.fromkeys((r["family"], r["size"], r["mixer"], r["baseline"]) for r in table))
    batches = sorted({r["batch"] for r in table})
    for i, key in enumerate(series):
        for j, b in enumerate(batches):
            pts = sorted((r["res"], r["speedup"], r.get("memory_saved")) for r in table
                         if (r["family"], r["size"], r["mixer"], r["baseline"]) == key and r["batch"] == b)
            if not pts:
                continue
            label = f"{key[0]}-{key[1]} {key[2]} vs {key[3]}" + (f", batch {b}" if len(batches) > 1 else "")
            kw = dict(marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[j % len(_STYLES)], color=f"C{i}")
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **kw)
            mem = [(p[0], 100 * p[2]) for p in pts if p[2] is not None]
            if mem:
                ax_m.plot([p[0] for p in mem], [p[1] for p in mem], label=label, **kw)
    ax_t.axhline(1.0, color="grey", lw=0.8)
    ax_m.axhline(0.0, color="grey", lw=0.8)
    ax_t.set(xlabel="resolution (px)", ylabel="throughput / baseline throughput", title="Relative throughput")
    ax_m.set(xlabel="resolution (px)", ylabel="memory saved (%)", title="Peak memory saved against the baseline")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        _legend(ax, 8)
    return _save(plt, fig, path)


def plot_models(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Throughput (top) and peak memory (bottom) against resolution, one column per family, one line per mixer
    and batch size."""
    from ssogvit.bench.model_sweep import BASELINE_NAMES

    ok = _ok(rows)
    if not ok:
        return None
    plt = _plt()
    families = sorted({(r["family"], r["size"]) for r in ok})
    fig, axes = plt.subplots(2, len(families), figsize=(4.6 * len(families), 7), squeeze=False)
    mixers = sorted({r["mixer"] for r in ok})
    batches = sorted({r["batch"] for r in ok})
    for c, fam in enumerate(families):
        ax_t, ax_m = axes[0][c], axes[1][c]
        for i, mixer in enumerate(mixers):
            for j, b in enumerate(batches):
                pts = sorted((r["res"], r.get("images_per_s"), r.get("peak_mib")) for r in ok
                             if (r["family"], r["size"]) == fam and r["mixer"] == mixer and r["batch"] == b)
                if not pts:
                    continue
                kw = dict(marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[j % len(_STYLES)], color=f"C{i}",
                          label=f"{BASELINE_NAMES.get(mixer, mixer)}, batch {b}")
                for ax, k in ((ax_t, 1), (ax_m, 2)):
                    drawn = [p for p in pts if p[k] is not None]
                    if drawn:
                        ax.plot([p[0] for p in drawn], [p[k] for p in drawn], **kw)
        ax_t.set(title=f"{fam[0]}-{fam[1]}", xlabel="resolution (px)", ylabel="throughput (images/s)", yscale="log")
        ax_m.set(xlabel="resolution (px)", ylabel="peak memory (MiB)", yscale="log")
        for ax in (ax_t, ax_m):
            ax.grid(alpha=0.3, which="both")
            _legend(ax, 7)
    return _save(plt, fig, path)


def plot_operator(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Operator peak memory (left) and time (right) against tokens on log-log axes, with the fitted ``N^k`` lines
    and their exponents in the legend."""
    from ssogvit.bench.operator_sweep import operator_fits

    ok = _ok(rows)
    if not ok:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, metric, ylabel in ((axes[0], "peak_mib", "peak memory (MiB)"), (axes[1], "time_ms", "time (ms)")):
        fits = operator_fits(ok, metric)
        keys = sorted({(r["label"], r["batch"]) for r in ok}, key=lambda k: (k[1], k[0]))
        for i, key in enumerate(keys):
            pts = sorted((r["tokens"], r[metric]) for r in ok if (r["label"], r["batch"]) == key and r.get(metric))
            if not pts:
                continue
            fit = fits.get(key)
            label = f"{key[0]} (batch {key[1]})" + (f": k = {fit.exponent:.2f}" if fit else "")
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], _MARKERS[i % len(_MARKERS)], color=color, label=label)
            if fit:
                xs = [pts[0][0], pts[-1][0]]
                ax.plot(xs, [fit(x) for x in xs], "-", color=color, lw=1)
        ax.set(xscale="log", yscale="log", xlabel="tokens N (class token included)", ylabel=ylabel)
        from matplotlib.ticker import NullFormatter

        ticks = sorted({r["tokens"] for r in ok})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        _legend(ax, 8)
    axes[0].set_title("Operator peak memory, fit memory ~ N^k")
    axes[1].set_title("Operator time, fit time ~ N^k")
    return _save(plt, fig, path)


def _legend(ax, fontsize: int) -> None:
    """A legend where the axes drew something labelled (a time-only run, ``--no-memory``, draws no memory lines)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
