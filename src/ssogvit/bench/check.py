"""``ssogvit bench check``: SSoG against attention at ViT-B width, each comparison judged against the threshold given,
or reported (docs/benchmarks.md)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ssogvit.bench.flops import flops_breakdown
from ssogvit.bench.sweeps import compare, model_points, operator_fits, operator_points
from ssogvit.models import create_model
from ssogvit.results import markdown_table

__all__ = ["Thresholds", "check_points", "evaluate", "format_check", "mixer_bound", "model_bound"]

RESOLUTIONS = (224, 384, 512, 640, 768, 1024)
DIM, HEADS, PATCH = 768, 12, 16  # ViT-B, R = 4 atoms (the default)
MIXERS = ("mha", "ssog", "ssog-steered")


@dataclass(frozen=True)
class Thresholds:
    """What ``evaluate`` judges (docs/benchmarks.md has the table); ``None`` reports the figure without a verdict."""

    min_bound_fraction: float | None = None
    min_model_speedup: float | None = None
    max_memory_ratio: float | None = None
    max_memory_exponent: float | None = None
    max_train_memory_ratio: float | None = None
    max_steered_time_ratio: float | None = None
    max_steered_memory_ratio: float | None = None


@functools.cache
def mixer_bound(res: int, whole_block: bool = False) -> float:
    """Fixed SSoG's speed-up over attention that FLOPs allow at ViT-B width: the mixer, or (``whole_block``) + MLP."""
    parts = [flops_breakdown(create_model(f"vit-base-{m}", depth=1, img_size=res), res) for m in ("mha", "ssog")]
    a, s = (p["mixer"] + (p["mlp"] if whole_block else 0) for p in parts)
    return a / s


#: ``model_bound(res)``: ``mixer_bound`` for a whole ViT-B block (mixer plus MLP)
model_bound = functools.partial(mixer_bound, whole_block=True)


def check_points(*, resolutions: Sequence[int] = RESOLUTIONS, batches: Sequence[int] = (1, 8),
                 models: Sequence[str] = ("vit-base",), model_batch: int = 1, train_resolutions: Sequence[int] = (),
                 train_batches: Sequence[int] = (1,), **common: Any) -> list[dict[str, Any]]:
    """Every point ``evaluate`` needs, in one list for ``run_sweep``; ``models`` are ``family-size`` stems."""
    common.pop("mode", None)  # each point has its own
    points = [dict(kind="matmul", label="matmul-2048", size=2048, batch=1, res=0, **common)]
    points += operator_points(MIXERS, dim=DIM, heads=HEADS, resolutions=resolutions, batches=batches, patch=PATCH,
                              prefix=1, mode="inference", **common)
    for family, size in (stem.split("-", 1) for stem in models):
        points += model_points([family], [size], ["mha", "ssog"], resolutions=resolutions, batches=[model_batch],
                               mode="inference", **common)
        points += model_points([family], [size], MIXERS, resolutions=train_resolutions, batches=train_batches,
                               mode="train", **common)
    return points


def evaluate(rows: Sequence[dict], limits: Thresholds = Thresholds()) -> list[dict]:
    """Benchmark rows -> check rows ``check, point, goal, measured, met, note`` (ratios as the tables take them; FLOP
    bounds from the points' counts, else ``mixer_bound``); ``met``: ``None`` without a threshold or a value."""
    idx = {(r["kind"], r.get("label"), r.get("res"), r.get("batch"), r.get("mode", "inference")): r
           for r in rows if r.get("status") == "ok"}
    out: list[dict] = []

    def add(check, point, value, limit=None, *, at_least=False, unit="", note=""):
        goal = "(reported)" if limit is None else (">= " if at_least else "<= ") + f"{limit:.2f}{unit}"
        met = None if limit is None or value is None else value >= limit if at_least else value <= limit
        out.append(dict(check=check, point=point, goal="" if value is None else goal, measured=value, met=met,
                        note=note))

    def memory(check, point, a, b, limit):
        if (ratio := compare(a, b, "time_ms").get("memory_ratio")) is not None:
            add(check, point, ratio, limit, unit="x", note=f"{a['peak_mib']:.1f} vs {b['peak_mib']:.1f} MiB")

    ops = [r for r in rows if r.get("kind") == "operator"]
    op_keys = sorted({(r["batch"], r["res"]) for r in ops})
    batches = sorted({b for b, _ in op_keys})
    for batch, res in op_keys:
        a, s, st = (idx.get(("operator", m, res, batch, "inference")) for m in MIXERS)
        point = f"res {res}, batch {batch}"
        if a is None or s is None:
            add("mixer: fixed SSoG vs fused attention", point, None, note="a point failed")
            continue
        if "speedup" in (ratios := compare(s, a, "time_ms")):
            bound = ratios.get("flop_bound") or mixer_bound(res)
            add("mixer speed-up, fraction of FLOP bound", point, ratios["speedup"] / bound, limits.min_bound_fraction,
                at_least=True, note=f"{ratios['speedup']:.2f}x of {bound:.2f}x")
        memory("mixer peak memory / fused attention", point, s, a, limits.max_memory_ratio)
        if st is not None:
            if "speedup" in (slower := compare(s, st, "time_ms")):  # steered time / fixed time
                add("steered time / fixed time (mixer)", point, slower["speedup"], limits.max_steered_time_ratio)
            memory("steered peak memory / fixed (mixer)", point, st, s, limits.max_steered_memory_ratio)
    fits = operator_fits(ops, "peak_mib")
    for fit, label, batch in ((fits[m, b], m, b) for b in batches for m in MIXERS if (m, b) in fits):
        add("memory exponent k (memory ~ N^k)", f"{label}, batch {batch}", fit.exponent,
            limits.max_memory_exponent if label == "ssog" else None, note=f"fit over {fit.points} points")
    for r in (r for r in rows if r.get("kind") == "model" and r.get("mixer") != "mha"):
        mode = r.get("mode", "inference")
        a = idx.get(("model", r["label"].removesuffix(r["mixer"]) + "mha", r["res"], r["batch"], mode))
        s = idx.get(("model", r["label"], r["res"], r["batch"], mode))
        point = f"{r['label']}, res {r['res']}, batch {r['batch']}"
        what = "training step" if mode == "train" else "whole model"
        if a is None or s is None:
            add(f"{what} vs MHA twin", point, None, note="a point failed")
            continue
        if "speedup" in (ratios := compare(s, a, "time_ms")):
            add(f"{what} speed-up vs MHA", point, ratios["speedup"], limits.min_model_speedup, at_least=True)
            if mode == "inference" and r["mixer"] == "ssog":
                bound = ratios.get("flop_bound") or model_bound(r["res"])
                add("whole model speed-up, fraction of FLOP bound", point, ratios["speedup"] / bound,
                    limits.min_bound_fraction, at_least=True)
        if mode == "train":
            memory("training step peak memory / MHA twin", point, s, a, limits.max_train_memory_ratio)
    peak = idx.get(("matmul", "matmul-2048", 0, 1, "inference"), {}).get("achieved_gflops_per_s")
    for batch in batches:
        rate = idx.get(("operator", "ssog", 1024, batch, "inference"), {}).get("achieved_gflops_per_s")
        if rate and peak:
            add("fixed mixer rate at 1024 / matmul peak", f"res 1024, batch {batch}", rate / peak,
                note=f"{rate:.1f} of {peak:.1f} GFLOP/s")
    return out


def format_check(rows: Sequence[dict]) -> str:
    """Markdown table of check rows."""
    lines = [[r["check"], r["point"], r["goal"], "n/a" if r["measured"] is None else f"{r['measured']:.2f}",
              {True: "yes", False: "**no**", None: "-"}[r["met"]], r["note"]] for r in rows]
    return markdown_table(["check", "point", "goal", "measured", "met", "note"], lines)
