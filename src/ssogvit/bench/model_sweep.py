"""Whole models: throughput and peak memory of each family x size x mixer over resolutions and batch sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["model_points", "model_table", "format_model_table"]


def model_points(
    families: Sequence[str],
    sizes: Sequence[str],
    mixers: Sequence[str],
    *,
    resolutions: Sequence[int],
    batches: Sequence[int],
    model_kwargs: dict[str, Any] | None = None,
    **common: Any,
) -> list[dict[str, Any]]:
    """Points for ``run_sweep``, ordered so that each configuration's batches run smallest first."""
    points = []
    for family in families:
        for size in sizes:
            for mixer in mixers:
                name = f"{family}-{size}-{mixer}"
                for res in resolutions:
                    for batch in sorted(batches):
                        points.append(
                            dict(
                                kind="model", label=name, model=name, family=family, size=size, mixer=mixer,
                                model_kwargs=dict(model_kwargs or {}), res=res, batch=batch, **common,
                            )
                        )
    return points


def model_table(rows: Sequence[dict], baseline: str = "mha") -> list[dict]:
    """Rows with ``speedup`` (throughput / the baseline mixer's) and ``memory_saved`` (1 - peak / baseline peak)
    against the same family, size, resolution and batch."""
    base = {
        (r["family"], r["size"], r["res"], r["batch"]): r
        for r in rows
        if r.get("mixer") == baseline and r.get("status") == "ok"
    }
    out = []
    for r in rows:
        row = dict(r)
        b = base.get((r["family"], r["size"], r["res"], r["batch"]))
        if b is not None and r.get("status") == "ok":
            row["speedup"] = r["images_per_s"] / b["images_per_s"]
            if b.get("peak_mib") and r.get("peak_mib") is not None:
                row["memory_saved"] = 1.0 - r["peak_mib"] / b["peak_mib"]
            if b.get("gflops_per_image") and r.get("gflops_per_image"):
                row["flop_bound"] = b["gflops_per_image"] / r["gflops_per_image"]
        out.append(row)
    return out


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, int | float) else "-"


def format_model_table(rows: Sequence[dict], baseline: str = "mha") -> str:
    """A Markdown table of throughput and memory, with the ratios against the ``baseline`` mixer."""
    lines = [
        f"| model | res | batch | img/s | ms / batch | peak MiB | GFLOPs / img | speed-up vs {baseline} | FLOP bound "
        f"| memory saved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in model_table(rows, baseline):
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {r['res']} | {r['batch']} | {r.get('status')} | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['label']} | {r['res']} | {r['batch']} | {_f(r.get('images_per_s'), '.2f')} "
            f"| {_f(r.get('time_ms_mean'), '.1f')} | {_f(r.get('peak_mib'), '.1f')} "
            f"| {_f(r.get('gflops_per_image'), '.1f')} | {_x(r.get('speedup'))} "
            f"| {_x(r.get('flop_bound'))} | {_f(r.get('memory_saved'), '.0%')} |"
        )
    return "\n".join(lines)
