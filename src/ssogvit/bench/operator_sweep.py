"""One mixer alone against attention at the token counts of each resolution (paper Table 3).

Mixers are named as for ``create_mixer`` (``"mha"``, ``"mha-unfused"``, ``"ssog"``, ``"ssog-steered"``), plus
``"torch-mha"`` for ``torch.nn.MultiheadAttention``; options follow a colon, ``"ssog:impl=einsum,num_atoms=8"``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from typing import Any

from ssogvit.bench.fit import PowerLaw, fit_power_law

__all__ = [
    "parse_mixer",
    "expand_impls",
    "operator_points",
    "operator_table",
    "operator_fits",
    "format_operator_table",
    "format_fits",
]


def _value(text: str) -> Any:
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
        options[key.strip()] = _value(value.strip())
    label = name + ("[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]" if options else "")
    return name, options, label


def expand_impls(mixers: Iterable[str], impls: Sequence[str] | None, device: str = "cpu") -> list[str]:
    """Repeat every SSoG mixer without an ``impl`` option once per name in ``impls`` (``["all"]``: every one that
    runs on ``device``; the Triton kernel needs CUDA)."""
    if not impls:
        return list(mixers)
    if list(impls) == ["all"]:
        from ssogvit.layers import SSOG_IMPLS

        impls = [i for i in SSOG_IMPLS if device == "cuda" or i != "triton"]
    out = []
    for m in mixers:
        name, options, _ = parse_mixer(m)
        if name.startswith("ssog") and "impl" not in options:
            sep = "," if ":" in m else ":"
            out += [f"{m}{sep}impl={i}" for i in impls]
        else:
            out.append(m)
    return out


def operator_points(
    mixers: Sequence[str],
    *,
    dim: int,
    heads: int,
    resolutions: Sequence[int],
    batches: Sequence[int],
    patch: int = 16,
    prefix: int = 1,
    **common: Any,
) -> list[dict[str, Any]]:
    """Points for ``run_sweep``: every mixer at every resolution and batch (square images, ``res // patch`` grid)."""
    points = []
    for res in resolutions:
        g = res // patch
        for batch in batches:
            for m in mixers:
                name, options, label = parse_mixer(m)
                points.append(
                    dict(
                        kind="operator", label=label, mixer=name, mixer_options=options, dim=dim, heads=heads,
                        res=res, grid=[g, g], prefix=prefix, tokens=prefix + g * g, batch=batch, **common,
                    )
                )
    return points


def operator_table(rows: Sequence[dict], baseline: str = "mha") -> list[dict]:
    """Rows with each point's time and memory beside the baseline mixer's at the same resolution and batch.

    Adds ``speedup`` (baseline time / this time), ``memory_ratio`` (this peak / baseline peak), ``flop_bound``
    (baseline FLOPs / this FLOPs: the speed-up a perfect implementation of both would show) and ``of_bound``
    (``speedup / flop_bound``).
    """
    base = {(r["res"], r["batch"]): r for r in rows if r.get("label") == baseline and r.get("status") == "ok"}
    out = []
    for r in rows:
        row = dict(r)
        b = base.get((r["res"], r["batch"]))
        if b is not None and r.get("status") == "ok":
            if b.get("time_ms") and r.get("time_ms"):
                row["speedup"] = b["time_ms"] / r["time_ms"]
            if b.get("peak_mib") and r.get("peak_mib") is not None:
                row["memory_ratio"] = r["peak_mib"] / b["peak_mib"]
            if b.get("gflops_per_image") and r.get("gflops_per_image"):
                row["flop_bound"] = b["gflops_per_image"] / r["gflops_per_image"]
                if "speedup" in row:
                    row["of_bound"] = row["speedup"] / row["flop_bound"]
        out.append(row)
    return out


def operator_fits(rows: Sequence[dict], metric: str = "peak_mib") -> dict[tuple[str, int], PowerLaw]:
    """Fit ``metric ~ tokens^k`` for each (mixer label, batch) series with at least two successful points."""
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get(metric):
            series.setdefault((r["label"], r["batch"]), []).append((r["tokens"], r[metric]))
    fits = {}
    for key, pts in series.items():
        try:
            fits[key] = fit_power_law([p[0] for p in pts], [p[1] for p in pts])
        except ValueError:
            continue
    return fits


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, int | float) else "-"


def format_operator_table(rows: Sequence[dict], baseline: str = "mha", matmul_peak: float | None = None) -> str:
    """A Markdown table: per resolution, batch and mixer, time, memory and the ratios against ``baseline``
    (with ``matmul_peak`` in GFLOP/s, also each mixer's achieved rate as a fraction of it)."""
    table = operator_table(rows, baseline)
    peak_head, peak_rule = (" of matmul peak |", "---|") if matmul_peak else ("", "")
    lines = [
        f"| res | tokens | batch | mixer | ms / call | peak MiB | GFLOP/s | speed-up vs {baseline} | FLOP bound "
        f"| of bound | memory / {baseline} |{peak_head}",
        "|---|---|---|---|---|---|---|---|---|---|---|" + peak_rule,
    ]
    for r in table:
        if r.get("status") != "ok":
            lines.append(f"| {r['res']} | {r['tokens']} | {r['batch']} | {r['label']} | {r.get('status')} "
                         "| - | - | - | - | - | - |" + (" - |" if matmul_peak else ""))
            continue
        lines.append(
            f"| {r['res']} | {r['tokens']} | {r['batch']} | {r['label']} | {_f(r.get('time_ms'), '.2f')} "
            f"| {_f(r.get('peak_mib'), '.1f')} | {_f(r.get('achieved_gflops_per_s'), '.1f')} "
            f"| {_x(r.get('speedup'))} | {_x(r.get('flop_bound'))} | {_f(r.get('of_bound'), '.0%')} "
            f"| {_x(r.get('memory_ratio'))} |"
            + (f" {_f(r.get('achieved_gflops_per_s', 0) / matmul_peak, '.0%')} |" if matmul_peak else "")
        )
    return "\n".join(lines)


def format_fits(rows: Sequence[dict]) -> str:
    """A Markdown table of the fitted exponents: memory and time against tokens, per mixer and batch."""
    mem = operator_fits(rows, "peak_mib")
    time = operator_fits(rows, "time_ms")
    lines = [
        "| mixer | batch | memory ~ N^k: k | R^2 | time ~ N^k: k | R^2 | points |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(mem) | set(time), key=lambda k: (k[1], k[0])):
        m, t = mem.get(key), time.get(key)
        lines.append(
            f"| {key[0]} | {key[1]} | {_f(m and m.exponent, '.3f')} | {_f(m and m.r2, '.4f')} "
            f"| {_f(t and t.exponent, '.3f')} | {_f(t and t.r2, '.4f')} | {(m or t).points} |"
        )
    return "\n".join(lines)
