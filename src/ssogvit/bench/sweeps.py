"""The sweeps (docs/benchmarks.md) as points, ratios to their baselines, power-law fits, tables and figures."""

from __future__ import annotations

import ast
import contextlib
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssogvit.layers import SSOG_IMPLS
from ssogvit.results import markdown_table, pyplot, save_figure

__all__ = ["BASELINE_NAMES", "PAPER_BASELINES", "PowerLaw", "cell", "compare", "default_mixers", "expand_impls",
           "fit_power_law", "format_fits", "format_model_table", "format_operator_table", "format_saved_table",
           "model_points", "model_table", "operator_fits", "operator_points", "operator_table", "parse_mixer",
           "parse_value", "plot_models", "plot_operator", "plot_relative"]

#: the baseline the paper benchmarks each family against, where it is not the fused ``mha``
PAPER_BASELINES = {"ode": "mha-unfused"}
#: how tables and plots name each baseline mixer
BASELINE_NAMES = {"mha": "mha (fused SDPA)", "mha-unfused": "mha-unfused (explicit attention, as the paper's ODE-ViT)"}


@dataclass(frozen=True)
class PowerLaw:
    """``y = coef * n ** exponent``, fitted by least squares on ``log y = log coef + exponent * log n``."""

    exponent: float
    coef: float
    r2: float
    points: int

    def __call__(self, n: float) -> float:
        return self.coef * n**self.exponent


def fit_power_law(n: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """``y ~ coef * n^exponent`` over the positive pairs; ``ValueError`` with fewer than two, or all ``n`` equal."""
    pairs = [(math.log(a), math.log(b)) for a, b in zip(n, y, strict=True) if a and b and a > 0 and b > 0]
    if len(pairs) < 2:
        raise ValueError(f"a power-law fit needs at least two positive points, got {len(pairs)}")
    xs, ys = zip(*pairs)
    if len(set(xs)) < 2:
        raise ValueError("a power-law fit needs at least two distinct n")
    k, c = statistics.linear_regression(xs, ys)
    r2 = statistics.correlation(xs, ys) ** 2 if len(set(ys)) > 1 else 1.0
    return PowerLaw(exponent=k, coef=math.exp(c), r2=r2, points=len(pairs))


def parse_value(text: str) -> Any:
    """A Python literal (``8``, ``0.5``, ``(1, 2)``, ``True``), else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_mixer(text: str) -> tuple[str, dict[str, Any], str]:
    """``"ssog:impl=einsum,num_atoms=8"`` -> ``("ssog", {"impl": "einsum", "num_atoms": 8}, label)``."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"mixer option {item!r} in {text!r} is not key=value")
        options[key.strip()] = parse_value(value.strip())
    return name, options, name + ("[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]" if options else "")


def expand_impls(mixers: Iterable[str], impls: Sequence[str] | None, device: str = "cpu") -> list[str]:
    """Each SSoG mixer without ``impl`` once per name in ``impls`` (``["all"]``: all that run on ``device``)."""
    if not impls:
        return list(mixers)
    if list(impls) == ["all"]:
        impls = [i for i in SSOG_IMPLS if device == "cuda" or i != "triton"]
    out = []
    for m in mixers:
        name, options, _ = parse_mixer(m)
        expand = name.startswith("ssog") and "impl" not in options
        out += [f"{m}{',' if ':' in m else ':'}impl={i}" for i in impls] if expand else [m]
    return out


def operator_points(mixers: Sequence[str], *, dim: int, heads: int, resolutions: Sequence[int],
                    batches: Sequence[int], patch: int = 16, prefix: int = 1, **common: Any) -> list[dict[str, Any]]:
    """Points for ``run_sweep``: every mixer at every resolution and batch (square images, ``res // patch`` grid)."""
    return [dict(kind="operator", label=label, mixer=name, mixer_options=options, dim=dim, heads=heads, res=res,
                 grid=[res // patch] * 2, prefix=prefix, tokens=prefix + (res // patch) ** 2, batch=batch, **common)
            for res in resolutions for batch in batches for name, options, label in map(parse_mixer, mixers)]


def default_mixers(family: str) -> list[str]:
    """The mixers ``ssogvit bench models`` measures for ``family`` without ``--mixers``."""
    return [PAPER_BASELINES[family], "mha", "ssog"] if family in PAPER_BASELINES else ["mha", "ssog"]


def model_points(families: Sequence[str], sizes: Sequence[str], mixers: Sequence[str] | None, *,
                 resolutions: Sequence[int], batches: Sequence[int], model_kwargs: dict[str, Any] | None = None,
                 **common: Any) -> list[dict[str, Any]]:
    """Points for ``run_sweep``, batches smallest first; ``mixers=None``: each family's ``default_mixers``."""
    return [dict(kind="model", label=f"{family}-{size}-{mixer}", model=f"{family}-{size}-{mixer}", family=family,
                 size=size, mixer=mixer, model_kwargs=dict(model_kwargs or {}), res=res, batch=batch, **common)
            for family in families for size in sizes
            for mixer in (mixers if mixers is not None else default_mixers(family))
            for res in resolutions for batch in sorted(batches)]


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def compare(r: dict, b: dict | None, speed: str) -> dict[str, float]:
    """``r``'s ``speedup`` over its baseline ``b`` (by ``"time_ms"`` or ``"images_per_s"``), ``memory_ratio``,
    ``flop_bound`` (the baseline's FLOPs over these) and ``of_bound`` (the fraction of it reached)."""
    out: dict[str, float] = {}
    if b is None or not _ok(r):
        return out
    if b.get(speed) and r.get(speed):
        out["speedup"] = b[speed] / r[speed] if speed == "time_ms" else r[speed] / b[speed]
    if b.get("peak_mib") and r.get("peak_mib") is not None:
        out["memory_ratio"] = r["peak_mib"] / b["peak_mib"]
    if b.get("gflops_per_image") and r.get("gflops_per_image"):
        out["flop_bound"] = b["gflops_per_image"] / r["gflops_per_image"]
        if "speedup" in out:
            out["of_bound"] = out["speedup"] / out["flop_bound"]
    return out


def operator_table(rows: Sequence[dict], baseline: str = "mha") -> list[dict]:
    """Rows with their ratios (``compare``) to the baseline mixer at the same resolution and batch."""
    base = {(r["res"], r["batch"]): r for r in rows if r.get("label") == baseline and _ok(r)}
    return [r | compare(r, base.get((r["res"], r["batch"])), "time_ms") for r in rows]


def operator_fits(rows: Sequence[dict], metric: str = "peak_mib") -> dict[tuple[str, int], PowerLaw]:
    """``metric ~ tokens^k`` for each (mixer label, batch) series with at least two successful points."""
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in (r for r in rows if _ok(r) and r.get(metric)):
        series.setdefault((r["label"], r["batch"]), []).append((r["tokens"], r[metric]))
    fits = {}
    for key, pts in series.items():
        with contextlib.suppress(ValueError):
            fits[key] = fit_power_law(*zip(*pts))
    return fits


def _mode(r: dict) -> str:
    return r.get("mode") or "inference"


def model_table(rows: Sequence[dict], baseline: str = "mha") -> list[dict]:
    """Rows tagged with their ``baseline`` and ratios to it (``compare`` by throughput, ``memory_saved``) at the same
    family, size, mode, resolution and batch; a group once per baseline it has, ``PAPER_BASELINES``' first."""
    out = []
    for family, size, mode in dict.fromkeys((r["family"], r["size"], _mode(r)) for r in rows):
        group = [r for r in rows if (r["family"], r["size"], _mode(r)) == (family, size, mode)]
        mixers = {r.get("mixer") for r in group} - {None}
        bases = [b for b in dict.fromkeys((PAPER_BASELINES.get(family), baseline)) if b in mixers] or [None]
        for name in bases:
            base = {(r["res"], r["batch"]): r for r in group if r.get("mixer") == name and _ok(r)}
            for r in (r for r in group if r.get("mixer") == name or r.get("mixer") not in bases):
                ratios = compare(r, base.get((r["res"], r["batch"])), "images_per_s") if r.get("mixer") != name else {}
                if "memory_ratio" in ratios:
                    ratios["memory_saved"] = 1.0 - ratios["memory_ratio"]
                out.append(r | ratios | {"baseline": name})
    return out


def cell(v: Any, fmt: str = ".2f", unit: str = "") -> str:
    """A number as a table cell (a ratio with ``unit="x"``: ``2.50x``), ``-`` for none."""
    return format(v, fmt) + unit if isinstance(v, int | float) else "-"


def _cells(r: dict, key: list, values: list) -> list:  # a failed point: its status and dashes for the values
    return key + (values if _ok(r) else [r.get("status")] + ["-"] * (len(values) - 1))


def format_operator_table(rows: Sequence[dict], baseline: str = "mha", matmul_peak: float | None = None) -> str:
    """Markdown: per resolution, batch and mixer, time, memory, ratios to ``baseline`` (and rate / ``matmul_peak``,
    in GFLOP/s, named above the table)."""
    head = ["res", "tokens", "batch", "mixer", "ms / call", "peak MiB", "GFLOP/s", f"speed-up vs {baseline}",
            "FLOP bound", "of bound", f"memory / {baseline}"] + (["of matmul peak"] if matmul_peak else [])
    lines = []
    for r in operator_table(rows, baseline):
        rate = r.get("achieved_gflops_per_s")
        lines.append(_cells(r, [r["res"], r["tokens"], r["batch"], r["label"]], [
            cell(r.get("time_ms")), cell(r.get("peak_mib"), ".1f"), cell(rate, ".1f"), cell(r.get("speedup"), unit="x"),
            cell(r.get("flop_bound"), unit="x"), cell(r.get("of_bound"), ".0%"), cell(r.get("memory_ratio"), unit="x"),
            *([cell((rate or 0) / matmul_peak, ".0%")] if matmul_peak else [])]))
    peak = f"matmul peak (2048^3 torch.mm): {matmul_peak:.1f} GFLOP/s\n\n" if matmul_peak else ""
    return peak + markdown_table(head, lines)


def format_fits(rows: Sequence[dict]) -> str:
    """Markdown: the fitted exponents of memory and time against tokens, per mixer and batch."""
    mem, time = operator_fits(rows, "peak_mib"), operator_fits(rows, "time_ms")
    fits = [(k, mem.get(k), time.get(k)) for k in sorted(set(mem) | set(time), key=lambda k: (k[1], k[0]))]
    lines = [[k[0], k[1], cell(m and m.exponent, ".3f"), cell(m and m.r2, ".4f"), cell(t and t.exponent, ".3f"),
              cell(t and t.r2, ".4f"), (m or t).points] for k, m, t in fits]
    return markdown_table(["mixer", "batch", "memory ~ N^k: k", "R^2", "time ~ N^k: k", "R^2", "points"], lines)


def format_model_table(rows: Sequence[dict], baseline: str = "mha") -> str:
    """Markdown: throughput, memory and ratios to each row's (named) baseline; a mode column if rows have several."""
    lines, modes = [], len({_mode(r) for r in rows}) > 1
    for r in model_table(rows, baseline):
        b = r["baseline"]
        compared = "-" if b is None else "(baseline)" if r.get("mixer") == b else BASELINE_NAMES.get(b, b)
        lines.append(_cells(r, [r["label"], compared, *([_mode(r)] if modes else []), r["res"], r["batch"]], [
            cell(r.get("images_per_s")), cell(r.get("time_ms"), ".1f"), cell(r.get("peak_mib"), ".1f"),
            cell(r.get("gflops_per_image"), ".1f"), cell(r.get("speedup"), unit="x"),
            cell(r.get("flop_bound"), unit="x"), cell(r.get("memory_saved"), ".0%")]))
    return markdown_table(["model", "compared with", *(["mode"] if modes else []), "res", "batch", "img/s",
                           "ms / batch", "peak MiB", "GFLOPs / img", "speed-up", "FLOP bound", "memory saved"], lines)


def format_saved_table(rows: Sequence[dict]) -> str:
    """Where a training step's bytes go (``--mode train``): per point, the step's peak beside what its forward saves
    for backward and the gradients (the larger is a lower bound of the peak, ``memory.saved_for_backward``), then
    what each module saves, under a heading. Empty when no row has the breakdown."""
    rows = [r for r in rows if _ok(r) and r.get("saved_by_module")]
    if not rows:
        return ""
    steps = []
    for r in rows:
        bound = max(r["saved_mib"], r.get("grads_mib") or 0.0)
        ratio = r["peak_mib"] / bound if r.get("peak_mib") and bound else None
        steps.append([r["label"], r["res"], r["batch"], cell(r.get("peak_mib"), ".1f"), cell(r.get("saved_mib"), ".1f"),
                      cell(r.get("grads_mib"), ".1f"), cell(ratio, unit="x"), cell(r.get("state_mib"), ".1f")])
    modules = [[r["label"], r["res"], r["batch"], module, f"{mib / calls:.2f}", calls, f"{mib:.1f}",
                f"{mib / r['saved_mib']:.0%}"] for r in rows for module, (mib, calls) in r["saved_by_module"].items()]
    return ("\nWhere the bytes go\n\n"
            + markdown_table(["model", "res", "batch", "step peak MiB", "saved for backward MiB", "gradients MiB",
                              "peak / lower bound", "parameters + optimizer MiB"], steps) + "\n"
            + markdown_table(["model", "res", "batch", "module", "MiB per application", "applications", "MiB",
                              "share"], modules))


# -- figures (PNG, in the paper's form; None: nothing to draw) -----------------------------------------------------

_STYLES, _MARKERS = ["-", "--", ":", "-."], ["o", "s", "^", "D", "v", "P", "X", "*"]


def _lines(ax, rows: Sequence[dict], y: str, label: str, i: int, batches: Sequence[int], scale: float = 1.0, *,
           name_batch: bool = True) -> None:
    """``scale * y`` of ``rows`` against resolution, where known: colour and marker ``i``, a line style per batch."""
    for j, b in enumerate(batches):
        pts = sorted((r["res"], scale * r[y]) for r in rows if r["batch"] == b and r.get(y) is not None)
        if pts:
            ax.plot(*zip(*pts), label=label + (f", batch {b}" if name_batch else ""),
                    marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[j % len(_STYLES)], color=f"C{i}")


def _finish(fig, axes, path: str | Path, fontsize: int) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # a time-only run (--no-memory) draws no memory lines
            ax.legend(fontsize=fontsize)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_relative(rows: Sequence[dict], path: str | Path, baseline: str = "mha") -> Path | None:
    """Throughput relative to the baseline and memory saved (%) against resolution: one line per family, mixer and
    baseline (``model_table``: the ODE family's paper baseline first), line style per batch size."""
    table = [r for r in model_table(rows, baseline) if r.get("mixer") != r["baseline"] and "speedup" in r]
    if not table:
        return None
    memory = any(r.get("memory_saved") is not None for r in table)  # a time-only run (--no-memory): one panel
    fig, axes = pyplot().subplots(1, 2 if memory else 1, figsize=(11 if memory else 6, 4.2), squeeze=False)
    ax_t, ax_m = axes[0][0], axes[0][1] if memory else None
    batches, modes = sorted({r["batch"] for r in table}), {_mode(r) for r in table}
    keys = dict.fromkeys((r["family"], r["size"], r["mixer"], r["baseline"], _mode(r)) for r in table)
    for i, key in enumerate(keys):
        group = [r for r in table if (r["family"], r["size"], r["mixer"], r["baseline"], _mode(r)) == key]
        label = f"{key[0]}-{key[1]} {key[2]} vs {key[3]}" + (f", {key[4]}" if len(modes) > 1 else "")
        _lines(ax_t, group, "speedup", label, i, batches, name_batch=len(batches) > 1)
        if memory:
            _lines(ax_m, group, "memory_saved", label, i, batches, 100, name_batch=len(batches) > 1)
    ax_t.axhline(1.0, color="grey", lw=0.8)
    ax_t.set(xlabel="resolution (px)", ylabel="throughput / baseline throughput", title="Relative throughput")
    if memory:
        ax_m.axhline(0.0, color="grey", lw=0.8)
        ax_m.set(xlabel="resolution (px)", ylabel="memory saved (%)", title="Peak memory saved against the baseline")
    return _finish(fig, tuple(axes[0]), path, 8)


def plot_models(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Throughput (top) and peak memory (bottom) against resolution: a column per family, a line per mixer and batch."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    families = sorted({(r["family"], r["size"], _mode(r)) for r in ok})
    panels = [("images_per_s", "throughput (images/s)")] + (  # a time-only run (--no-memory): no memory row
        [("peak_mib", "peak memory (MiB)")] if any(r.get("peak_mib") is not None for r in ok) else [])
    fig, axes = pyplot().subplots(len(panels), len(families), figsize=(4.6 * len(families), 3.5 * len(panels)),
                                  squeeze=False)
    mixers, batches = sorted({r["mixer"] for r in ok}), sorted({r["batch"] for r in ok})
    for c, fam in enumerate(families):
        for i, mixer in enumerate(mixers):
            group = [r for r in ok if (r["family"], r["size"], _mode(r)) == fam and r["mixer"] == mixer]
            for row, (y, _) in enumerate(panels):
                _lines(axes[row][c], group, y, BASELINE_NAMES.get(mixer, mixer), i, batches)
        for row, (_, label) in enumerate(panels):
            axes[row][c].set(xlabel="resolution (px)", ylabel=label, yscale="log")
        axes[0][c].set(title=f"{fam[0]}-{fam[1]}, {fam[2]}")
    return _finish(fig, [ax for col in axes for ax in col], path, 7)


def plot_operator(rows: Sequence[dict], path: str | Path) -> Path | None:
    """Operator peak memory (left) and time (right) against tokens, log-log, with fitted ``N^k`` lines (k in legend)."""
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
                ax.plot(*zip(*pts), _MARKERS[i % len(_MARKERS)], color=f"C{i}", label=label)
                if fit:
                    ax.plot([pts[0][0], pts[-1][0]], [fit(pts[0][0]), fit(pts[-1][0])], "-", color=f"C{i}", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="tokens N (class token included)", ylabel=ylabel, title=title)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    return _finish(fig, axes, path, 8)
