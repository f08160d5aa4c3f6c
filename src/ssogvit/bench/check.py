"""``ssogvit bench check``: the points that compare SSoG with attention, judged against the thresholds given.

At ViT-B width (D = 768, 12 heads, R = 4, patch 16), each point in its own process: the mixer alone (fused attention,
fixed and steered SSoG) at every resolution and batch, whole models against their MHA twin (inference), training
steps (forward, backward, AdamW step), and a 2048^3 matmul, the machine's dense rate. Each threshold given
(``Thresholds``) is a pass/fail verdict; a comparison without one is reported. The FLOP bound a perfect
implementation would reach is the ratio of the two points' FLOP counts (``ssogvit.bench.flops``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ssogvit.bench.sweeps import fit_power_law, model_points, operator_points
from ssogvit.results import markdown_table

__all__ = ["Thresholds", "check_points", "evaluate", "format_check", "mixer_bound", "model_bound"]

RESOLUTIONS = (224, 384, 512, 640, 768, 1024)
DIM, HEADS, PATCH = 768, 12, 16  # ViT-B, R = 4 atoms (the default)
MIXERS = ("mha", "ssog", "ssog-steered")


@dataclass(frozen=True)
class Thresholds:
    """What ``evaluate`` judges; ``None`` reports the figure without a verdict.

    Attributes:
        min_bound_fraction: fixed SSoG's speed-up over attention (mixer alone and whole model, inference) at least
            this fraction of the FLOP bound.
        min_model_speedup: whole model and training step at least this much faster than the MHA twin.
        max_memory_ratio: the mixer's peak memory at most this multiple of fused attention's.
        max_memory_exponent: fixed SSoG's fitted ``k`` in ``memory ~ N^k`` at most this.
        max_train_memory_ratio: a training step's peak memory at most this multiple of the MHA twin's.
        max_steered_time_ratio: steered SSoG's time at most this multiple of fixed SSoG's (mixer alone).
        max_steered_memory_ratio: steered SSoG's peak memory at most this multiple of fixed SSoG's.
    """

    min_bound_fraction: float | None = None
    min_model_speedup: float | None = None
    max_memory_ratio: float | None = None
    max_memory_exponent: float | None = None
    max_train_memory_ratio: float | None = None
    max_steered_time_ratio: float | None = None
    max_steered_memory_ratio: float | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@functools.cache
def _block_flops(res: int, mixer: str, *, whole_block: bool) -> int:
    """FLOPs of one ViT-B block's mixer (and MLP, ``whole_block``) at ``res``, counted on the modules."""
    from ssogvit.bench.flops import flops_breakdown
    from ssogvit.models import create_model

    parts = flops_breakdown(create_model(f"vit-base-{mixer}", depth=1, img_size=res), res)
    return parts["mixer"] + (parts["mlp"] if whole_block else 0)


def mixer_bound(res: int) -> float:
    """The speed-up of fixed SSoG over attention that the FLOP counts allow at ViT-B width, mixer alone."""
    return _block_flops(res, "mha", whole_block=False) / _block_flops(res, "ssog", whole_block=False)


def model_bound(res: int) -> float:
    """The same bound for a whole ViT-B block (mixer plus MLP)."""
    return _block_flops(res, "mha", whole_block=True) / _block_flops(res, "ssog", whole_block=True)


def check_points(*, resolutions: Sequence[int] = RESOLUTIONS, batches: Sequence[int] = (1, 8),
                 models: Sequence[str] = ("vit-base",), model_batch: int = 1, train_resolutions: Sequence[int] = (),
                 train_batches: Sequence[int] = (1,), **common: Any) -> list[dict[str, Any]]:
    """Every point ``evaluate`` needs, in one list for ``run_sweep``; ``models`` are ``family-size`` stems."""
    common = {k: v for k, v in common.items() if k != "mode"}
    points = [dict(kind="matmul", label="matmul-2048", size=2048, batch=1, res=0, **common)]
    points += operator_points(MIXERS, dim=DIM, heads=HEADS, resolutions=resolutions, batches=batches, patch=PATCH,
                              prefix=1, mode="inference", **common)
    for stem in models:
        family, size = stem.split("-", 1)
        points += model_points([family], [size], ["mha", "ssog"], resolutions=resolutions, batches=[model_batch],
                               mode="inference", **common)
        points += model_points([family], [size], MIXERS, resolutions=train_resolutions, batches=train_batches,
                               mode="train", **common)
    return points


def _row(check: str, point: str, goal: str, measured: float | None, ok: bool | None, note: str = "") -> dict:
    return dict(check=check, point=point, goal=goal, measured=measured, met=ok, note=note)


def _judged(check: str, point: str, value: float, limit: float | None, *, at_least: bool, unit: str = "",
            note: str = "") -> dict:
    if limit is None:
        return _row(check, point, "(reported)", value, None, note)
    goal = (">= " if at_least else "<= ") + f"{limit:.2f}{unit}"
    return _row(check, point, goal, value, value >= limit if at_least else value <= limit, note)


def _memory(check: str, point: str, a: dict, b: dict, limit: float | None) -> list[dict]:
    """``a``'s peak memory as a multiple of ``b``'s, judged against ``limit`` (nothing if either was not measured)."""
    if not (b.get("peak_mib") and a.get("peak_mib") is not None):
        return []
    return [_judged(check, point, a["peak_mib"] / b["peak_mib"], limit, at_least=False, unit="x",
                    note=f"{a['peak_mib']:.1f} vs {b['peak_mib']:.1f} MiB")]


def _speedup(a: dict, b: dict) -> float | None:
    """How many times faster ``a`` ran than ``b`` (``None`` if either was not timed)."""
    return b["time_ms"] / a["time_ms"] if a.get("time_ms") and b.get("time_ms") else None


def _flop_ratio(a: dict, b: dict) -> float | None:
    """``a``'s FLOPs over ``b``'s as counted at the points, if both were."""
    return a["gflops_per_image"] / b["gflops_per_image"] if a.get("gflops_per_image") and b.get(
        "gflops_per_image") else None


def evaluate(rows: Sequence[dict], limits: Thresholds = Thresholds()) -> list[dict]:
    """Benchmark rows -> check rows ``check, point, goal, measured, met, note`` (``met`` ``None``: no threshold given,
    or a point failed)."""
    idx = {(r["kind"], r.get("label"), r.get("res"), r.get("batch"), r.get("mode", "inference")): r
           for r in rows if r.get("status") == "ok"}
    out: list[dict] = []
    ops = [r for r in rows if r.get("kind") == "operator"]
    op_keys = sorted({(r["batch"], r["res"]) for r in ops})
    for batch, res in op_keys:
        a, s, st = (idx.get(("operator", m, res, batch, "inference")) for m in MIXERS)
        point = f"res {res}, batch {batch}"
        if a is None or s is None:
            out.append(_row("mixer: fixed SSoG vs fused attention", point, "", None, None, "a point failed"))
            continue
        speedup, bound = _speedup(s, a), _flop_ratio(a, s) or mixer_bound(res)
        if speedup is not None:
            out.append(_judged("mixer speed-up, fraction of FLOP bound", point, speedup / bound,
                               limits.min_bound_fraction, at_least=True, note=f"{speedup:.2f}x of {bound:.2f}x"))
        out += _memory("mixer peak memory / fused attention", point, s, a, limits.max_memory_ratio)
        if st is not None:
            if _speedup(s, st) is not None:  # steered time / fixed time
                out.append(_judged("steered time / fixed time (mixer)", point, _speedup(s, st),
                                   limits.max_steered_time_ratio, at_least=False))
            out += _memory("steered peak memory / fixed (mixer)", point, st, s, limits.max_steered_memory_ratio)
    for batch in sorted({b for b, _ in op_keys}):
        for label in MIXERS:
            pts = [(r["tokens"], r["peak_mib"]) for r in ops if r.get("label") == label and r.get("batch") == batch
                   and r.get("status") == "ok" and r.get("peak_mib")]
            if len(pts) >= 2:
                k = fit_power_law([p[0] for p in pts], [p[1] for p in pts]).exponent
                out.append(_judged("memory exponent k (memory ~ N^k)", f"{label}, batch {batch}", k,
                                   limits.max_memory_exponent if label == "ssog" else None, at_least=False,
                                   note=f"fit over {len(pts)} points"))
    for r in (r for r in rows if r.get("kind") == "model" and r.get("mixer") != "mha"):
        mode = r.get("mode", "inference")
        a = idx.get(("model", r["label"].removesuffix(r["mixer"]) + "mha", r["res"], r["batch"], mode))
        s = idx.get(("model", r["label"], r["res"], r["batch"], mode))
        point, what = f"{r['label']}, res {r['res']}, batch {r['batch']}", "training step" if mode == "train" else (
            "whole model")
        if a is None or s is None:
            out.append(_row(f"{what} vs MHA twin", point, "", None, None, "a point failed"))
            continue
        speedup = _speedup(s, a)
        if speedup is not None:
            out.append(_judged(f"{what} speed-up vs MHA", point, speedup, limits.min_model_speedup, at_least=True))
            if mode == "inference" and r["mixer"] == "ssog":
                out.append(_judged("whole model speed-up, fraction of FLOP bound", point,
                                   speedup / (_flop_ratio(a, s) or model_bound(r["res"])), limits.min_bound_fraction,
                                   at_least=True))
        if mode == "train":
            out += _memory("training step peak memory / MHA twin", point, s, a, limits.max_train_memory_ratio)
    mm = idx.get(("matmul", "matmul-2048", 0, 1, "inference"))
    for batch in sorted({b for b, _ in op_keys}):
        s = idx.get(("operator", "ssog", 1024, batch, "inference"))
        if mm and s and s.get("achieved_gflops_per_s") and mm.get("achieved_gflops_per_s"):
            rate, peak = s["achieved_gflops_per_s"], mm["achieved_gflops_per_s"]
            out.append(_row("fixed mixer rate at 1024 / matmul peak", f"res 1024, batch {batch}", "(reported)",
                            rate / peak, None, f"{rate:.1f} of {peak:.1f} GFLOP/s"))
    return out


def format_check(rows: Sequence[dict]) -> str:
    """Markdown table of check rows."""
    lines = [[r["check"], r["point"], r["goal"], "n/a" if r["measured"] is None else f"{r['measured']:.2f}",
              {True: "yes", False: "**no**", None: "-"}[r["met"]], r["note"]] for r in rows]
    return markdown_table(["check", "point", "goal", "measured", "met", "note"], lines)
