"""The performance targets of SSoG (issue 6), each a row of one benchmark run: target beside measurement.

``ssogvit bench targets`` runs, each point in its own process, at ViT-B width (D = 768, 12 heads, R = 4, patch 16):

- the mixer alone, fixed SSoG against fused attention, batch 1 and 8, at every resolution: time and peak memory;
- steered SSoG beside them (time at 512, memory everywhere);
- the whole discrete ViT-B, SSoG against MHA, inference at every resolution and one training step at 384 and 768;
- a large matmul, the machine's dense rate, against which the fixed mixer's achieved rate at 1024 is reported.

The bound a perfect implementation would reach is the ratio of multiply-adds (with ``N = g^2 + 1`` tokens on a
``g x g`` grid): attention ``4 N D^2 + 2 N^2 D``, SSoG ``2 N D^2 + R D g^2 (2 g)``, plus ``8 N D^2`` per block of MLP for
the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ssogvit.bench.fit import fit_power_law

__all__ = ["mixer_bound", "model_bound", "target_points", "evaluate_targets", "format_targets"]

RESOLUTIONS = (224, 384, 512, 640, 768, 1024)
#: The two peak-memory measures of a CPU point (``ssogvit.bench.memory``) and their names in the table.
_MEMORY_MEASURES = (("peak_mib", "resident"), ("torch_peak_mib", "PyTorch allocations"))
DIM, HEADS, ATOMS, PATCH = 768, 12, 4, 16


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


def target_points(
    *,
    resolutions: Sequence[int] = RESOLUTIONS,
    batches: Sequence[int] = (1, 8),
    train_resolutions: Sequence[int] = (384, 768),
    model_batch: int = 1,
    train_batch: int = 1,
    **common: Any,
) -> list[dict[str, Any]]:
    """Every point the targets need, in one list for ``run_sweep``."""
    points: list[dict[str, Any]] = [dict(kind="matmul", label="matmul-2048", size=2048, batch=1, res=0, **common)]
    mixers = [("mha", "mha", {}), ("ssog", "ssog", {}), ("ssog-steered", "ssog-steered", {})]
    for res in resolutions:
        g = res // PATCH
        for batch in batches:
            for label, name, options in mixers:
                points.append(
                    dict(
                        kind="operator", label=label, mixer=name, mixer_options=options, dim=DIM, heads=HEADS,
                        res=res, grid=[g, g], prefix=1, tokens=1 + g * g, batch=batch, **common,
                    )
                )
    for res in resolutions:
        for mixer in ("mha", "ssog"):
            points.append(
                dict(kind="model", label=f"vit-base-{mixer}", model=f"vit-base-{mixer}", res=res, batch=model_batch,
                     mode="inference", **common)
            )
    for res in train_resolutions:
        for mixer in ("mha", "ssog"):
            points.append(
                dict(kind="model", label=f"vit-base-{mixer}", model=f"vit-base-{mixer}", res=res, batch=train_batch,
                     mode="train", **common)
            )
    return points


def _index(rows: Sequence[dict]) -> dict[tuple, dict]:
    out = {}
    for r in rows:
        if r.get("status") == "ok":
            out[(r["kind"], r.get("label"), r.get("res"), r.get("batch"), r.get("mode", "inference"))] = r
    return out


def _row(target: str, point: str, goal: str, measured: float | None, ok: bool | None, note: str = "") -> dict:
    return dict(target=target, point=point, goal=goal, measured=measured, met=ok, note=note)


def evaluate_targets(rows: Sequence[dict]) -> list[dict]:
    """Turn benchmark rows into target rows: ``target, point, goal, measured, met, note``."""
    idx = _index(rows)
    out: list[dict] = []

    def get(kind, label, res, batch, mode="inference"):
        return idx.get((kind, label, res, batch, mode))

    op_res = sorted({r["res"] for r in rows if r.get("kind") == "operator"})
    op_batches = sorted({r["batch"] for r in rows if r.get("kind") == "operator"})
    for batch in op_batches:
        for res in op_res:
            a, s = get("operator", "mha", res, batch), get("operator", "ssog", res, batch)
            point = f"res {res}, batch {batch}"
            if a is None or s is None:
                out.append(_row("mixer speed-up >= 90% of bound", point, "", None, None, "a point failed"))
                continue
            bound = mixer_bound(res)
            speedup = a["time_ms_median"] / s["time_ms_median"]
            out.append(_row("mixer speed-up >= 90% of bound", point, f">= {0.9 * bound:.2f}x (bound {bound:.2f}x)",
                            speedup, speedup >= 0.9 * bound, f"{speedup / bound:.0%} of bound"))
    for batch in op_batches:
        for res in op_res:
            a, s = get("operator", "mha", res, batch), get("operator", "ssog", res, batch)
            if a and s and a.get("peak_mib") and s.get("peak_mib") is not None:
                ratio = s["peak_mib"] / a["peak_mib"]
                out.append(_row("mixer peak memory <= 0.75x fused attention", f"res {res}, batch {batch}", "<= 0.75x",
                                ratio, ratio <= 0.75,
                                f"{s['peak_mib']:.1f} vs {a['peak_mib']:.1f} MiB" + _torch_note(s, a)))
    for metric, what in _MEMORY_MEASURES:
        for batch in op_batches:
            for label in ("mha", "ssog", "ssog-steered"):
                pts = [(r["tokens"], r[metric]) for r in rows if r.get("kind") == "operator"
                       and r.get("label") == label and r.get("batch") == batch and r.get("status") == "ok"
                       and r.get(metric)]
                if len(pts) >= 2:
                    fit = fit_power_law([p[0] for p in pts], [p[1] for p in pts])
                    goal = "<= 1.05" if label == "ssog" else "(reported)"
                    out.append(_row(f"memory exponent k (memory ~ N^k, {what})", f"{label}, batch {batch}", goal,
                                    fit.exponent, fit.exponent <= 1.05 if label == "ssog" else None,
                                    f"fit over {len(pts)} points"))
    model_res = sorted({r["res"] for r in rows if r.get("kind") == "model" and r.get("mode") == "inference"})
    for res in model_res:
        batch = next((r["batch"] for r in rows if r.get("kind") == "model" and r.get("res") == res), 1)
        a, s = get("model", "vit-base-mha", res, batch), get("model", "vit-base-ssog", res, batch)
        point = f"res {res}, batch {batch}"
        if a is None or s is None:
            out.append(_row("whole ViT-B faster than MHA", point, "", None, None, "a point failed"))
            continue
        bound = model_bound(res)
        speedup = a["time_ms_median"] / s["time_ms_median"]
        goal, ok = "> 1.00x", speedup > 1.0
        if res in (512, 1024):
            goal = f"> 1.00x and >= {0.9 * bound:.2f}x (bound {bound:.2f}x)"
            ok = ok and speedup >= 0.9 * bound
        out.append(_row("whole ViT-B faster than MHA", point, goal, speedup, ok, f"{speedup / bound:.0%} of bound"))
    train_res = sorted({r["res"] for r in rows if r.get("kind") == "model" and r.get("mode") == "train"})
    for res in train_res:
        batch = next((r["batch"] for r in rows if r.get("mode") == "train" and r.get("res") == res), 1)
        a = get("model", "vit-base-mha", res, batch, "train")
        s = get("model", "vit-base-ssog", res, batch, "train")
        point = f"res {res}, batch {batch}"
        if a is None or s is None:
            out.append(_row("training step: faster, no more memory", point, "", None, None, "a point failed"))
            continue
        speedup = a["time_ms_median"] / s["time_ms_median"]
        out.append(_row("training step speed-up (fwd+bwd)", point, "> 1.00x", speedup, speedup > 1.0))
        for metric, what in _MEMORY_MEASURES:
            if a.get(metric) and s.get(metric) is not None:
                ratio = s[metric] / a[metric]
                out.append(_row(f"training step peak memory ({what})", point, "<= 1.00x", ratio, ratio <= 1.0,
                                f"{s[metric]:.0f} vs {a[metric]:.0f} MiB"))
    for batch in op_batches:
        f, st = get("operator", "ssog", 512, batch), get("operator", "ssog-steered", 512, batch)
        if f and st:
            ratio = st["time_ms_median"] / f["time_ms_median"]
            out.append(_row("steered time / fixed time", f"res 512, batch {batch}", "<= 2.00x", ratio, ratio <= 2.0))
    for batch in op_batches:
        for res in op_res:
            f, st = get("operator", "ssog", res, batch), get("operator", "ssog-steered", res, batch)
            if f and st and f.get("peak_mib") and st.get("peak_mib") is not None:
                ratio = st["peak_mib"] / f["peak_mib"]
                out.append(_row("steered peak memory / fixed", f"res {res}, batch {batch}", "<= 1.50x", ratio,
                                ratio <= 1.5, _torch_note(st, f).removeprefix("; ")))
    mm = next((r for r in rows if r.get("kind") == "matmul" and r.get("status") == "ok"), None)
    for batch in op_batches:
        s = get("operator", "ssog", 1024, batch)
        if mm and s and s.get("achieved_gflops_per_s"):
            frac = s["achieved_gflops_per_s"] / mm["achieved_gflops_per_s"]
            out.append(_row("fixed mixer rate at 1024 / matmul peak", f"res 1024, batch {batch}", "(reported)", frac,
                            None, f"{s['achieved_gflops_per_s']:.1f} of {mm['achieved_gflops_per_s']:.1f} GFLOP/s"))
    return out


def _torch_note(s: dict, a: dict) -> str:
    if s.get("torch_peak_mib") is not None and a.get("torch_peak_mib"):
        return f"; PyTorch allocations {s['torch_peak_mib'] / a['torch_peak_mib']:.2f}x"
    return ""


def format_targets(rows: Sequence[dict]) -> str:
    """Markdown table of target rows."""
    lines = ["| target | point | goal | measured | met | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["measured"]
        measured = "n/a" if m is None else f"{m:.2f}"
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(f"| {r['target']} | {r['point']} | {r['goal']} | {measured} | {met} | {r['note']} |")
    return "\n".join(lines)
