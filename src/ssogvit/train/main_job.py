"""`ssogvit main`: train a small SSoG ViT and its MHA twin on the embedded digits data, then compare them.

Both runs are the experiments `digits_vit_ssog` and `digits_vit_mha` (ssogvit/conf/experiment/), identical except
for the mixer, each written to `<out>/<mixer>/` (checkpoints/, logs/, tb/, export/, config.yaml); both models'
training curves are drawn in `<out>/curves.png`. `<out>` is always
a fresh folder: when `--out` (or the default `runs/main/<date-time>`) already holds a run, `<out>-2`, `<out>-3`, ...
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "format_table", "SSOG_TARGET"]

SSOG_TARGET = 90.0  # validation top-1 (%) the SSoG model must reach


def format_table(rows: list[dict[str, Any]]) -> str:
    """Side-by-side table of run summaries (from `ssogvit.train.run.train`)."""
    head = f"{'model':<16} {'params':>9} {'val top-1':>10} {'top-3':>7} {'top-5':>7} {'val loss':>9} {'best top-1':>11} " \
           f"{'epochs':>6} {'time':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r["metrics"]
        lines.append(
            f"{r['model']:<16} {r['parameters'] / 1e3:>8.1f}k {m.get('val/top1', float('nan')):>9.2f}% "
            f"{m.get('val/top3', float('nan')):>6.2f}% {m.get('val/top5', float('nan')):>6.2f}% "
            f"{m.get('val/loss', float('nan')):>9.4f} {r['best']:>10.2f}% {r['epochs']:>6d} {r['time_s']:>7.1f}s"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from ssogvit.errors import report_errors

    from ssogvit.errors import ArgumentParser

    parser = ArgumentParser(
        prog="ssogvit main",
        description="Train a small SSoG ViT and its MHA twin on the embedded digits data (no download) and print a "
        "side-by-side table. Extra arguments are Hydra overrides applied to both runs.",
    )
    parser.add_argument("--out", default=None, help="output folder (default runs/main/<date-time>)")
    parser.add_argument("--epochs", type=int, default=None, help="override the experiments' epoch count")
    parser.add_argument("--mixers", default="ssog,mha", help="comma-separated, from ssog, mha (default both)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: these matrices are too small to share, and a second "
                        "thread that waits for a busy core slows every step down)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, overrides = parser.parse_known_args(argv)
    return report_errors("ssogvit main", lambda: _run(parser, args, overrides))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from .config import compose
    from .errors import ConfigError
    from .run import train
    from .run_folder import fresh_folder

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    asked = Path(args.out or Path("runs") / "main" / time.strftime("%Y%m%d-%H%M%S")).expanduser()
    mixers = [m.strip() for m in args.mixers.split(",") if m.strip()]
    for m in mixers:
        if m not in ("ssog", "mha"):
            raise ConfigError(f"unknown mixer {m!r} in --mixers; choose from ssog, mha")
    out = fresh_folder(asked, parts=tuple(mixers))  # never into a folder that holds a run
    if out != asked:
        print(f"ssogvit main: {asked} holds another run; writing to {out}")

    print(f"ssogvit main: SSoG vs its MHA twin on scikit-learn's digits (1438 train / 359 val images), "
          f"{torch.get_num_threads()} CPU threads; writing to {out}")
    start = time.perf_counter()
    rows = []
    for mixer in mixers:
        run_overrides = [f"experiment=digits_vit_{mixer}", f"output_dir={out / mixer}", "resume=null"]
        if args.epochs:
            run_overrides.append(f"trainer.max_epochs={args.epochs}")
        if args.no_progress:
            run_overrides.append("trainer.enable_progress_bar=false")
        if not torch.cuda.is_available():
            run_overrides.append("trainer.accelerator=cpu")
        cfg = compose(run_overrides + list(overrides))
        print(f"\n-- training {cfg.model.name} ({cfg.trainer.max_epochs} epochs, {cfg.data.img_size} px, "
              f"patch {cfg.model.kwargs.patch_size}) --")
        rows.append(train(cfg, verbose=False))
    total = time.perf_counter() - start

    print("\n" + format_table(rows))
    print(f"\ntotal wall time {total:.1f} s ({total / 60:.2f} min)")
    from .curves import plot_training_curves

    curves = plot_training_curves({r["model"]: r["output_dir"] for r in rows}, out / "curves.png",
                                  title="SSoG vs its MHA twin on digits")
    print(f"training curves: {curves}" if curves else "training curves: none drawn (no CSV log; logger without csv)")
    for r in rows:
        print(f"{r['model']}: checkpoints {r['checkpoints']}/ (best.ckpt, last.ckpt), logs {r['logs']}/ (CSV) and "
              f"{r['tensorboard']}/ (tensorboard --logdir {out}), weights {r['export']}")
    ssog = next((r for r in rows if r["model"].endswith("-ssog")), None)
    if ssog is not None:
        top1 = ssog["metrics"].get("val/top1", 0.0)
        ok = top1 >= SSOG_TARGET
        print(f"SSoG validation top-1 {top1:.2f}% {'>=' if ok else '<'} {SSOG_TARGET:.0f}% target: "
              f"{'reached' if ok else 'NOT reached'}")
        return 0 if ok else 1
    return 0
