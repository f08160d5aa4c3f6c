"""Read the runs of scripts/convert_evidence.sh and write the evidence of docs/conversion.md: top-1 against optimizer
steps (mean over seeds, band from the lowest to the highest seed) for every recipe and for training from scratch,
and the steps each needs to reach the teacher's top-1 minus one point.

    python scripts/convert_evidence_plot.py --root /tmp/i13 --teacher-top1 92.48 --png docs/img/conversion_steps.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def curve(run: Path) -> list[tuple[int, float]]:
    """``(optimizer steps, val top-1)`` of one run, over all its log versions. Lightning logs a validation that
    follows the n-th optimizer step at step n - 1, so one is added."""
    points = {}
    for f in sorted(run.glob("logs/version_*/metrics.csv")):
        for row in csv.DictReader(f.open()):
            if row.get("val/top1"):
                points[int(row["step"]) + 1] = float(row["val/top1"])
    return sorted(points.items())


def first_reach(points: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, v in points if v >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/i13")
    parser.add_argument("--teacher-top1", type=float, required=True)
    parser.add_argument("--png", default="docs/img/conversion_steps.png")
    parser.add_argument("--at", type=int, default=132, help="also report the mean top-1 after this many steps")
    args = parser.parse_args()
    root, target = Path(args.root), args.teacher_top1 - 1.0
    groups = {"from scratch": sorted((root / "scratch").glob("s*"))}
    for recipe in sorted((root / "convert").glob("*")):
        groups[f"convert: {recipe.name}"] = sorted(recipe.glob("s*"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    print(f"target: teacher {args.teacher_top1:.2f}% - 1 = {target:.2f}%\n")
    print(f"| run | seeds | steps run | top-1 after {args.at} steps (mean) | final top-1 (mean, min-max) | "
          "best top-1 (mean) | steps to target per seed | steps to target (mean curve) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, runs in groups.items():
        curves = [c for c in (curve(r) for r in runs) if c]
        if not curves:
            continue
        steps = sorted(set.intersection(*({s for s, _ in c} for c in curves)))
        table = [dict(c) for c in curves]
        mean = [sum(t[s] for t in table) / len(table) for s in steps]
        ax.plot(steps, mean, label=f"{label} ({len(curves)} seeds)")
        ax.fill_between(steps, [min(t[s] for t in table) for s in steps], [max(t[s] for t in table) for s in steps],
                        alpha=0.15)
        finals = [c[-1][1] for c in curves]
        reach = [first_reach(c, target) for c in curves]
        mean_reach = first_reach(list(zip(steps, mean)), target)
        at = f"{mean[steps.index(args.at)]:.2f}" if args.at in steps else "n/a"
        print(f"| {label} | {len(curves)} | {curves[0][-1][0]} | {at} | {sum(finals) / len(finals):.2f} "
              f"({min(finals):.2f}-{max(finals):.2f}) | {sum(max(v for _, v in c) for c in curves) / len(curves):.2f} "
              f"| {', '.join('not reached' if r is None else str(r) for r in reach)} "
              f"| {'not reached' if mean_reach is None else mean_reach} |")
    ax.axhline(target, color="k", ls="--", lw=0.8, label=f"teacher - 1 point ({target:.1f}%)")
    ax.set_xlabel("optimizer steps (batch 64)")
    ax.set_ylabel("val top-1 (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
