"""``ssogvit bench check``: run the points that compare SSoG with attention and judge them against thresholds.

At ViT-B width (D = 768, 12 heads, R = 4, patch 16) by default, each point in its own process: the mixer alone (fused
attention, fixed and steered SSoG) at every resolution and batch; whole models (inference), SSoG against their MHA
twin; training steps of whole models (forward, backward, AdamW step); a large matmul, the machine's dense rate. Each
threshold the user gives (``Thresholds``) becomes a pass/fail column; a comparison without a threshold is reported.

The FLOP bound a perfect implementation would reach is the ratio of the two points' FLOPs as ``ssogvit.bench.flops``
counts them (docs/benchmarks.md); ``mixer_bound`` and ``model_bound`` give it in closed form at ViT-B width (with
``N = g^2 + 1`` tokens on a ``g x g`` grid, attention ``4 N D^2 + 2 N^2 D`` multiply-adds, SSoG
``2 N D^2 + R D g^2 (2 g)``, plus ``8 N D^2`` per block of MLP for the whole model), used when a row has no count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ssogvit.bench.fit import fit_power_law

__all__ = ["Thresholds", "mixer_bound", "model_bound", "check_points", "evaluate", "format_check"]

RESOLUTIONS = (224, 384, 512, 640, 768, 1024)
DIM, HEADS, ATOMS, PATCH = 768, 12, 4, 16


@dataclass(frozen=True)
class Thresholds:
    """What ``evaluate`` judges; ``None`` reports the figure without a verdict.

    Attributes:
        min_bound_fraction: fixed SSoG's speed-up over attention, mixer alone and whole model (inference), at least
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


def _macs(res: int, dim: int, atoms: int, patch: int) -> tuple[float, float, float]:
    g = res // patch
    n = g * g + 1
    attn = 4 * n * dim**2 + 2 * n**2 * dim
    ssog = 2 * n * dim**2 + atoms * dim * g * g * (2 * g)
    mlp = 8 * n * dim**2
    return attn, ssog, mlp


def mixer_bound(res: int, dim: int = DIM, atoms: int = ATOMS, patch: int = PATCH) -> float:
    """Speed-up of fixed SSoG over attention that the multiply-add counts allow, mixer alone."""
    attn, ssog, _ = _macs(res, dim, atoms, patch)
    return attn / ssog


def model_bound(res: int, dim: int = DIM, atoms: int = ATOMS, patch: int = PATCH) -> float:
    """The same bound for a whole ViT block (mixer plus MLP)."""
    attn, ssog, mlp = _macs(res, dim, atoms, patch)
    return (attn + mlp) / (ssog + mlp)


def check_points(
    *,
    resolutions: Sequence[int] = RESOLUTIONS,
    batches: Sequence[int] = (1, 8),
    models: Sequence[str] = ("vit-base",),
    model_batch: int = 1,
    train_resolutions: Sequence[int] = (),
    train_batches: Sequence[int] = (1,),
    **common: Any,
) -> list[dict[str, Any]]:
    """Every point ``evaluate`` needs, in one list for ``run_sweep``. ``models`` are ``family-size`` stems."""
    common = {k: v for k, v in common.items() if k != "mode"}
    points: list[dict[str, Any]] = [dict(kind="matmul", label="matmul-2048", size=2048, batch=1, res=0, **common)]
    for res in resolutions:
        g = res // PATCH
        for batch in batches:
            for mixer in ("mha", "ssog", "ssog-steered"):
                points.append(dict(kind="operator", label=mixer, mixer=mixer, mixer_options={}, dim=DIM, heads=HEADS,
                                   res=res, grid=[g, g], prefix=1, tokens=1 + g * g, batch=batch, **common))

    def model_point(stem, mixer, res, batch, mode):
        return dict(kind="model", label=f"{stem}-{mixer}", model=f"{stem}-{mixer}", family=stem.split("-")[0],
                    mixer=mixer, res=res, batch=batch, **common, mode=mode)

    for stem in models:
        points += [model_point(stem, m, res, model_batch, "inference") for res in resolutions for m in ("mha", "ssog")]
        points += [model_point(stem, m, res, b, "train") for res in train_resolutions for b in sorted(train_batches)
                   for m in ("mha", "ssog", "ssog-steered")]
    return points


def _row(check: str, point: str, goal: str, measured: float | None, ok: bool | None, note: str = "") -> dict:
    return dict(check=check, point=point, goal=goal, measured=measured, met=ok, note=note)


def _judge(value: float, limit: float | None, *, at_least: bool) -> tuple[str, bool | None]:
    if limit is None:
        return "(reported)", None
    return (f">= {limit:.2f}" if at_least else f"<= {limit:.2f}"), (value >= limit if at_least else value <= limit)


def _memory_row(name: str, point: str, a: dict, b: dict, limit: float | None) -> dict | None:
    """``a``'s peak memory as a multiple of ``b``'s, judged against ``limit``."""
    if not (b.get("peak_mib") and a.get("peak_mib") is not None):
        return None
    ratio = a["peak_mib"] / b["peak_mib"]
    goal, ok = _judge(ratio, limit, at_least=False)
    return _row(name, point, goal + ("x" if limit is not None else ""), ratio, ok,
                f"{a['peak_mib']:.1f} vs {b['peak_mib']:.1f} MiB")


def _flop_ratio(a: dict, b: dict) -> float | None:
    """``a``'s FLOPs over ``b``'s, as counted at the points (``ssogvit.bench.flops``), if both were counted."""
    return a["gflops_per_image"] / b["gflops_per_image"] if a.get("gflops_per_image") and b.get(
        "gflops_per_image") else None


def _speedup(a: dict, b: dict) -> float | None:
    """How many times faster ``a`` ran than ``b`` (``None`` if either was not timed)."""
    return b["time_ms"] / a["time_ms"] if a.get("time_ms") and b.get("time_ms") else None


def evaluate(rows: Sequence[dict], limits: Thresholds = Thresholds()) -> list[dict]:
    """Turn benchmark rows into check rows: ``check, point, goal, measured, met, note`` (``met`` ``None``: no
    threshold given, or a point failed)."""
    idx = {(r["kind"], r.get("label"), r.get("res"), r.get("batch"), r.get("mode", "inference")): r
           for r in rows if r.get("status") == "ok"}
    out: list[dict] = []
    ops = [r for r in rows if r.get("kind") == "operator"]
    op_keys = sorted({(r["batch"], r["res"]) for r in ops})
    for batch, res in op_keys:
        a, s, st = (idx.get(("operator", m, res, batch, "inference")) for m in ("mha", "ssog", "ssog-steered"))
        point = f"res {res}, batch {batch}"
        if a is None or s is None:
            out.append(_row("mixer: fixed SSoG vs fused attention", point, "", None, None, "a point failed"))
            continue
        speedup, bound = _speedup(s, a), _flop_ratio(a, s) or mixer_bound(res)
        if speedup is not None:
            frac = speedup / bound
            goal, ok = _judge(frac, limits.min_bound_fraction, at_least=True)
            out.append(_row("mixer speed-up, fraction of FLOP bound", point, goal, frac, ok,
                            f"{speedup:.2f}x of {bound:.2f}x"))
        out.append(_memory_row("mixer peak memory / fused attention", point, s, a, limits.max_memory_ratio))
        if st is not None:
            ratio = _speedup(s, st)  # steered time / fixed time
            if ratio is not None:
                goal, ok = _judge(ratio, limits.max_steered_time_ratio, at_least=False)
                out.append(_row("steered time / fixed time (mixer)", point, goal, ratio, ok))
            out.append(_memory_row("steered peak memory / fixed (mixer)", point, st, s,
                                   limits.max_steered_memory_ratio))
    for batch in sorted({b for b, _ in op_keys}):
        for label in ("mha", "ssog", "ssog-steered"):
            pts = [(r["tokens"], r["peak_mib"]) for r in ops if r.get("label") == label and r.get("batch") == batch
                   and r.get("status") == "ok" and r.get("peak_mib")]
            if len(pts) >= 2:
                k = fit_power_law([p[0] for p in pts], [p[1] for p in pts]).exponent
                goal, ok = _judge(k, limits.max_memory_exponent if label == "ssog" else None, at_least=False)
                out.append(_row("memory exponent k (memory ~ N^k)", f"{label}, batch {batch}", goal, k, ok,
                                f"fit over {len(pts)} points"))
    models = [r for r in rows if r.get("kind") == "model" and r.get("mixer") != "mha"]
    for r in models:
        mode = r.get("mode", "inference")
        twin = r["label"].removesuffix(r["mixer"]) + "mha"
        a = idx.get(("model", twin, r["res"], r["batch"], mode))
        s = idx.get(("model", r["label"], r["res"], r["batch"], mode))
        point = f"{r['label']}, res {r['res']}, batch {r['batch']}"
        what = "training step" if mode == "train" else "whole model"
        if a is None or s is None:
            out.append(_row(f"{what} vs MHA twin", point, "", None, None, "a point failed"))
            continue
        speedup = _speedup(s, a)
        if speedup is not None:
            goal, ok = _judge(speedup, limits.min_model_speedup, at_least=True)
            out.append(_row(f"{what} speed-up vs MHA", point, goal, speedup, ok))
            if mode == "inference" and r["mixer"] == "ssog":
                frac = speedup / (_flop_ratio(a, s) or model_bound(res=r["res"]))
                goal, ok = _judge(frac, limits.min_bound_fraction, at_least=True)
                out.append(_row("whole model speed-up, fraction of FLOP bound", point, goal, frac, ok))
        if mode == "train":
            out.append(_memory_row("training step peak memory / MHA twin", point, s, a, limits.max_train_memory_ratio))
    mm = idx.get(("matmul", "matmul-2048", 0, 1, "inference"))
    for batch in sorted({b for b, _ in op_keys}):
        s = idx.get(("operator", "ssog", 1024, batch, "inference"))
        if mm and s and s.get("achieved_gflops_per_s") and mm.get("achieved_gflops_per_s"):
            frac = s["achieved_gflops_per_s"] / mm["achieved_gflops_per_s"]
            out.append(_row("fixed mixer rate at 1024 / matmul peak", f"res 1024, batch {batch}", "(reported)", frac,
                            None, f"{s['achieved_gflops_per_s']:.1f} of {mm['achieved_gflops_per_s']:.1f} GFLOP/s"))
    return [r for r in out if r is not None]


def format_check(rows: Sequence[dict]) -> str:
    """Markdown table of check rows."""
    lines = ["| check | point | goal | measured | met | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["measured"]
        measured = "n/a" if m is None else f"{m:.2f}"
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(f"| {r['check']} | {r['point']} | {r['goal']} | {measured} | {met} | {r['note']} |")
    return "\n".join(lines)
