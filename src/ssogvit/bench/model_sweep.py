"""Whole models: throughput and peak memory of each family x size x mixer over resolutions and batch sizes.

The paper benchmarks its continuous-depth baseline, ODE-ViT, with explicit attention (`softmax(Q K^T / sqrt(d)) V`,
the mixer `mha-unfused`) and the discrete and looped baselines with PyTorch's fused SDPA (`mha`). By default the ODE
family is measured with both: the paper-faithful pair (SSoG against `mha-unfused`) comes first, then SSoG against the
fused `mha`; every row of the table and every line of the plots names the baseline it is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["model_points", "model_table", "format_model_table", "default_mixers", "baselines_of", "BASELINE_NAMES",
           "PAPER_BASELINES", "format_saved_table"]

#: the baseline that the paper benchmarks each family against, where it is not the fused `mha`
PAPER_BASELINES = {"ode": "mha-unfused"}
#: how tables and plots name each baseline mixer
BASELINE_NAMES = {"mha": "mha (fused SDPA)", "mha-unfused": "mha-unfused (explicit attention, as the paper's ODE-ViT)"}


def default_mixers(family: str) -> list[str]:
    """The mixers `ssogvit bench models` measures for `family` when `--mixers` is not given."""
    return [PAPER_BASELINES[family], "mha", "ssog"] if family in PAPER_BASELINES else ["mha", "ssog"]


def baselines_of(family: str, mixers: Sequence[str], baseline: str = "mha") -> list[str]:
    """The baselines present among `mixers` that `family`'s other mixers are compared with, the paper's first."""
    order = [PAPER_BASELINES.get(family), baseline]
    return [b for i, b in enumerate(order) if b is not None and b in mixers and b not in order[:i]]


def model_points(
    families: Sequence[str],
    sizes: Sequence[str],
    mixers: Sequence[str] | None,
    *,
    resolutions: Sequence[int],
    batches: Sequence[int],
    model_kwargs: dict[str, Any] | None = None,
    **common: Any,
) -> list[dict[str, Any]]:
    """Points for ``run_sweep``, ordered so that each configuration's batches run smallest first.

    `mixers=None` takes each family's `default_mixers` (the ODE family adds the paper's explicit-attention baseline).
    """
    points = []
    for family in families:
        for size in sizes:
            for mixer in (mixers if mixers is not None else default_mixers(family)):
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
    """Rows with ``speedup`` (throughput / the baseline's), ``memory_saved`` (1 - peak / baseline peak) and
    ``flop_bound`` against the same family, size, resolution and batch, each tagged with the ``baseline`` it is
    compared with.

    Each family is compared with each of its `baselines_of` in turn (the paper's first): a baseline's own rows and
    the rows of every non-baseline mixer appear once per baseline, grouped by family, size and baseline.
    """
    out = []
    keys = list(dict.fromkeys((r["family"], r["size"]) for r in rows))
    for family, size in keys:
        group = [r for r in rows if (r["family"], r["size"]) == (family, size)]
        present = [r.get("mixer") for r in group]
        bases = baselines_of(family, present, baseline) or [None]
        for b_name in bases:
            ok_base = {(r["res"], r["batch"]): r for r in group if r.get("mixer") == b_name and r.get("status") == "ok"}
            for r in group:
                if r.get("mixer") != b_name and r.get("mixer") in bases:
                    continue  # another baseline: shown in its own group
                row = dict(r, baseline=b_name)
                b = ok_base.get((r["res"], r["batch"]))
                if b is not None and r.get("status") == "ok" and r.get("mixer") != b_name:
                    if b.get("images_per_s") and r.get("images_per_s"):
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
    """A Markdown table of throughput and memory, with the ratios against each row's baseline (named in the table)."""
    lines = [
        "| model | compared with | res | batch | img/s | ms / batch | peak MiB | GFLOPs / img | speed-up | FLOP bound "
        "| memory saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in model_table(rows, baseline):
        b = r["baseline"]
        against = "-" if b is None else "(baseline)" if r.get("mixer") == b else BASELINE_NAMES.get(b, b)
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {against} | {r['res']} | {r['batch']} | {r.get('status')} "
                         "| - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['label']} | {against} | {r['res']} | {r['batch']} | {_f(r.get('images_per_s'), '.2f')} "
            f"| {_f(r.get('time_ms'), '.1f')} | {_f(r.get('peak_mib'), '.1f')} "
            f"| {_f(r.get('gflops_per_image'), '.1f')} | {_x(r.get('speedup'))} "
            f"| {_x(r.get('flop_bound'))} | {_f(r.get('memory_saved'), '.0%')} |"
        )
    return "\n".join(lines)


def format_saved_table(rows: Sequence[dict]) -> str:
    """Where a training step's bytes go (``--mode train``): per point, the step's peak beside what its forward saves
    for backward and the parameters' gradients (the larger is a lower bound of the peak,
    ``ssogvit.bench.memory.saved_for_backward``), then per point and module what it saves. Empty when no row has
    the breakdown."""
    rows = [r for r in rows if r.get("status") == "ok" and r.get("saved_by_module")]
    if not rows:
        return ""
    lines = [
        "| model | res | batch | step peak MiB | saved for backward MiB | gradients MiB | peak / lower bound "
        "| parameters + optimizer MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = max(r["saved_mib"], r.get("grads_mib") or 0.0)
        ratio = r["peak_mib"] / bound if r.get("peak_mib") and bound else None
        lines.append(f"| {r['label']} | {r['res']} | {r['batch']} | {_f(r.get('peak_mib'), '.1f')} "
                     f"| {_f(r.get('saved_mib'), '.1f')} | {_f(r.get('grads_mib'), '.1f')} | {_x(ratio)} "
                     f"| {_f(r.get('state_mib'), '.1f')} |")
    lines += ["", "| model | res | batch | module | MiB per application | applications | MiB | share |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for module, (mib, calls) in r["saved_by_module"].items():
            lines.append(f"| {r['label']} | {r['res']} | {r['batch']} | {module} | {mib / calls:.2f} | {calls} "
                         f"| {mib:.1f} | {mib / r['saved_mib']:.0%} |")
    return "\n".join(lines)
