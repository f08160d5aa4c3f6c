"""`ssogvit main`: SSoG (fixed and steered) against its MHA twin on the 8x8 digits grid, both heads, several seeds.

What it trains is data, `ssogvit/conf/main.yaml` (the plan): experiments `digits8_vit_<mixer>`
(ssogvit/conf/experiment/), each with its own head (the one that suits the mixer: mean-pooled for SSoG, class token
for MHA, docs/models.md) and the heads the plan lists, each (experiment, head) with every seed of the plan. The runs
are independent processes of a stdlib `multiprocessing` pool (`--jobs`, one torch thread each by default); each run
is written to `<out>/<mixer>/<head>/seed<N>/` (checkpoints/, logs/, tb/, export/, config.yaml) and the training
curves to `<out>/curves.png`. `<out>` is always a fresh folder: when `--out` (or the default
`runs/main/<date-time>`) already holds a run, `<out>-2`, `<out>-3`, ...

The job exits with status 1 when SSoG misses the plan's target (docs/training.md says why this target).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["main", "MainRun", "load_plan", "plan_runs", "format_table", "check_target", "HEADS"]

HEADS = ("avg", "token")


@dataclass(frozen=True)
class MainRun:
    """One training run of the main job: an experiment with a head and a seed, written to `folder`."""

    experiment: str
    mixer: str
    head: str
    seed: int
    folder: Path
    overrides: tuple[str, ...]


def load_plan() -> dict[str, Any]:
    """The main job's plan, `ssogvit/conf/main.yaml`: `runs` (`{experiment, heads}`), `seeds`, `target`."""
    from importlib import resources

    from omegaconf import OmegaConf

    from .config import CONFIG_MODULE

    text = (resources.files(CONFIG_MODULE) / "main.yaml").read_text()
    return OmegaConf.to_container(OmegaConf.create(text), resolve=False)


def experiment_model(experiment: str) -> tuple[str, str]:
    """`(mixer, own head)` of an experiment: its `model.mixer` and `model.kwargs.global_pool` (null: token)."""
    from .config import compose

    cfg = compose([f"experiment={experiment}"])
    return str(cfg.model.mixer), str(cfg.model.kwargs.get("global_pool") or "token")


def plan_runs(out: Path, plan: dict[str, Any], overrides: Sequence[str] = (), *, mixers: Sequence[str] | None = None,
              heads: Sequence[str] | None = None, seeds: Sequence[int] | None = None) -> list[MainRun]:
    """Every (experiment, head, seed) run of `plan` (`mixers`, `heads`, `seeds` replace the plan's choices), the
    steered experiments first: they are the slowest, so that the pool ends with short runs."""
    runs = []
    for entry in plan["runs"]:
        mixer, _ = experiment_model(entry["experiment"])
        if mixers is not None and mixer not in mixers:
            continue
        for head in heads or entry["heads"]:
            for seed in seeds or plan["seeds"]:
                runs.append(MainRun(entry["experiment"], mixer, head, int(seed), out / mixer / head / f"seed{seed}",
                                    tuple(overrides)))
    return sorted(runs, key=lambda r: "steered" not in r.mixer)


def run_overrides(run: MainRun, epochs: int | None) -> list[str]:
    """The Hydra overrides of one run: its experiment, head, seed and folder, then the user's overrides."""
    import torch

    out = [f"experiment={run.experiment}", f"model.kwargs.global_pool={run.head}", f"seed={run.seed}",
           f"output_dir={run.folder}", "resume=null", "progress.mode=none"]
    if epochs is not None:
        out.append(f"trainer.max_epochs={epochs}")
    if not torch.cuda.is_available():
        out.append("trainer.accelerator=cpu")
    return out + list(run.overrides)


def _init_worker(threads: int) -> None:
    """A pool process: `threads` torch threads; Lightning's info lines, its few-workers hint (the runs are the
    parallel workers here) and a deprecation inside Lightning silenced."""
    import torch

    torch.set_num_threads(threads)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # Lightning 2.6 on torch 2.14: not ours to act on


def _train_one(args: tuple[MainRun, int | None]) -> tuple[MainRun, dict[str, Any]]:
    from .config import compose
    from .run import train

    run, epochs = args
    summary = train(compose(run_overrides(run, epochs)), verbose=False)
    keep = ("model", "parameters", "metrics", "best", "epochs", "time_s", "output_dir")
    return run, {k: summary[k] for k in keep}


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:6.2f} ± {sd:5.2f}"


def group_results(results: list[tuple[MainRun, dict[str, Any]]]) -> dict[tuple[str, str], list[tuple[int, dict]]]:
    """`{(mixer, head): [(seed, summary), ...]}` in plan order, seeds ascending."""
    groups: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for run, summary in results:
        groups.setdefault((run.mixer, run.head), []).append((run.seed, summary))
    return {k: sorted(v, key=lambda item: item[0]) for k, v in groups.items()}


def top1s(entries: list[tuple[int, dict]]) -> list[float]:
    return [float(s["metrics"].get("val/top1", math.nan)) for _, s in entries]


def format_table(groups: dict[tuple[str, str], list[tuple[int, dict]]], suited: dict[str, str]) -> str:
    """One row per (model, head): parameters, validation top-1 as mean ± sample standard deviation over the seeds and
    per seed, the mean validation loss and the mean wall time of a run; `*` marks the mixer's own head."""
    seeds = sorted({seed for entries in groups.values() for seed, _ in entries})
    head = (f"{'model':<22} {'head':<7} {'params':>7}  {'val top-1 %':>15}  "
            + " ".join(f"{'seed ' + str(s):>7}" for s in seeds) + f"  {'val loss':>8} {'time/run':>8}")
    lines = [head, "-" * len(head)]
    for (mixer, pool), entries in groups.items():
        first = entries[0][1]
        by_seed = {seed: float(s["metrics"].get("val/top1", math.nan)) for seed, s in entries}
        loss = statistics.fmean(float(s["metrics"].get("val/loss", math.nan)) for _, s in entries)
        mark = "*" if suited.get(mixer) == pool else " "
        lines.append(
            f"{first['model']:<22} {pool + ' ' + mark:<7} {first['parameters'] / 1e3:>6.1f}k  "
            f"{_spread(top1s(entries)):>15}  "
            + " ".join(f"{by_seed[s]:>7.2f}" if s in by_seed else f"{'-':>7}" for s in seeds)
            + f"  {loss:>8.4f} {statistics.fmean(s['time_s'] for _, s in entries):>7.1f}s"
        )
    lines.append("* the mixer's own head (its experiment's); ± is the sample standard deviation over the seeds")
    return "\n".join(lines)


def check_target(groups: dict[tuple[str, str], list[tuple[int, dict]]], suited: dict[str, str],
                 target: dict[str, float]) -> tuple[bool, str]:
    """Whether fixed SSoG with its head meets `target` (the plan's `margin` over MHA with its head, and `min_top1`
    for every seed), and the line that says so."""
    ssog, mha = groups.get(("ssog", suited.get("ssog", ""))), groups.get(("mha", suited.get("mha", "")))
    if not ssog:
        return True, "target not checked: fixed SSoG with its own head was not trained (--mixers / --heads)"
    lowest = min(top1s(ssog))
    ok = lowest >= target["min_top1"]
    words = [f"every SSoG seed >= {target['min_top1']:.0f}% (lowest {lowest:.2f}%)"]
    if mha:
        gap = statistics.fmean(top1s(ssog)) - statistics.fmean(top1s(mha))
        ok = ok and gap >= target["margin"]
        words.append(f"SSoG ({suited['ssog']}) - MHA ({suited['mha']}) mean top-1 {gap:+.2f} points "
                     f"(target >= +{target['margin']:.0f})")
    return ok, f"target {'reached' if ok else 'NOT reached'}: " + "; ".join(words)


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated choice of `allowed` names (`ssogvit.inputs.Choice` each), in the order given, each once."""
    from ssogvit.inputs import Choice, InputError

    def refuse(problem: str) -> InputError:
        return InputError(f"--{what} {text!r}: {problem}; expected a comma-separated list from {', '.join(allowed)}",
                          argument=f"--{what}")

    names, choice = [n.strip() for n in text.split(",") if n.strip()], Choice(tuple(allowed))
    if not names:
        raise refuse("no name given")
    checked = []
    for name in names:
        try:
            checked.append(choice.check(name, f"--{what}"))
        except InputError:
            raise refuse(f"unknown {what.rstrip('s')} {name!r}") from None
    return list(dict.fromkeys(checked))


def main(argv: list[str]) -> int:
    from ssogvit.errors import report_errors
    from ssogvit.inputs import SEED, Int, Ints

    from ssogvit.errors import ArgumentParser

    at_least_one = Int(low=1).argparse
    parser = ArgumentParser(
        prog="ssogvit main",
        description="Train SSoG (fixed and steered) and its MHA twin on the 8x8 grid of the embedded digits (no "
        "download), with both heads and three seeds, in parallel processes, and print the table (mean ± sd and every "
        "seed). What it trains is ssogvit/conf/main.yaml. Extra arguments are Hydra overrides applied to every run.",
    )
    parser.add_argument("--out", default=None, help="output folder (default runs/main/<date-time>)")
    parser.add_argument("--epochs", type=at_least_one, default=None,
                        help="override the experiments' epoch count (12)")
    parser.add_argument("--mixers", default=None, help="only these mixers, comma-separated (ssog, ssog-steered, mha)")
    parser.add_argument("--heads", default=None, help="every experiment with these heads, comma-separated: avg (mean "
                        "of the patch tokens), token (class token); default the plan's")
    parser.add_argument("--seeds", type=Ints(item=SEED).argparse, default=None,
                        help="comma-separated seeds (default the plan's: 0,1,2)")
    parser.add_argument("--jobs", type=at_least_one, default=2, help="runs trained at once, each in its own process "
                        "(default 2)")
    parser.add_argument("--threads", type=at_least_one, default=1,
                        help="torch CPU threads per run (default 1: these matrices are too small to share)")
    parser.add_argument("--no-progress", action="store_true", help="no line per finished run")
    args, overrides = parser.parse_known_args(argv)
    return report_errors("ssogvit main", lambda: _run(args, overrides))


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from ssogvit.outputs import FolderLock, check_output_folder

    from .config import check_run_config, compose
    from .run_folder import fresh_folder

    plan = load_plan()
    known = {entry["experiment"]: experiment_model(entry["experiment"]) for entry in plan["runs"]}
    suited = {mixer: head for mixer, head in known.values()}
    mixers = _names(args.mixers, list(suited), "mixers") if args.mixers is not None else None
    heads = _names(args.heads, HEADS, "heads") if args.heads is not None else None
    choice = dict(mixers=mixers, heads=heads, seeds=args.seeds)
    asked = Path(args.out or Path("runs") / "main" / time.strftime("%Y%m%d-%H%M%S")).expanduser()
    probe = plan_runs(asked, plan, overrides, **choice)
    out = fresh_folder(asked, parts=tuple(str(r.folder.relative_to(asked)) for r in probe))  # never into a run
    if out != asked:
        print(f"ssogvit main: {asked} holds another run; writing to {out}")
    runs = plan_runs(out, plan, overrides, **choice)
    for run in runs:  # every override and value checked before any process starts or anything is written
        check_run_config(compose(run_overrides(run, args.epochs)))
    check_output_folder(out, "--out")
    with FolderLock(out, elsewhere="choose another --out"):  # one live job per folder; each run has its own lock
        return _train_all(args, plan, suited, runs, out)


def _train_all(args: argparse.Namespace, plan: dict[str, Any], suited: dict[str, str], runs: list[MainRun],
               out: Path) -> int:
    import multiprocessing

    from .config import compose
    from .curves import plot_training_curves

    cfg = compose(run_overrides(runs[0], args.epochs))
    side = cfg.data.img_size // cfg.model.kwargs.patch_size
    jobs = min(args.jobs, len(runs))
    print(f"ssogvit main: {len(runs)} runs ({', '.join(dict.fromkeys(r.mixer for r in runs))}; heads and seeds as "
          f"in the table) on scikit-learn's digits at {cfg.data.img_size} px, patch {cfg.model.kwargs.patch_size} "
          f"({side}x{side} tokens), {cfg.trainer.max_epochs} epochs, {jobs} at a time with {args.threads} torch "
          f"thread(s) each; writing to {out}", flush=True)
    start = time.perf_counter()
    results = []
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no state inherited from this process
    # SIGINT and SIGTERM raise `Interrupted` here (ssogvit.cli): leaving the `with` terminates the pool, so no run is
    # left training as an orphan; each run's last.ckpt is in its folder
    with context.Pool(jobs, initializer=_init_worker, initargs=(args.threads,)) as pool:
        for run, summary in pool.imap_unordered(_train_one, [(r, args.epochs) for r in runs]):
            results.append((run, summary))
            if not args.no_progress:
                print(f"[{len(results)}/{len(runs)}] {summary['model']} {run.head} seed {run.seed}: val top-1 "
                      f"{summary['metrics'].get('val/top1', math.nan):.2f}% ({summary['time_s']:.1f} s)", flush=True)
    total = time.perf_counter() - start
    shown = [entry["experiment"] for entry in plan["runs"]]  # the table in the plan's order
    results.sort(key=lambda item: (shown.index(item[0].experiment), HEADS.index(item[0].head)
                                   if item[0].head != suited[item[0].mixer] else -1, item[0].seed))
    groups = group_results(results)

    print("\n" + format_table(groups, suited))
    print(f"\ntotal wall time {total:.1f} s ({total / 60:.2f} min)")
    seeds = sorted({r.seed for r in runs})
    curves = plot_training_curves(
        {f"{entries[0][1]['model']} ({pool})": [s["output_dir"] for _, s in entries]
         for (_, pool), entries in groups.items()},
        out / "curves.png", title=f"8x8 digits grid: mean over seeds {', '.join(map(str, seeds))} "
                                  "(band: lowest to highest seed)")
    print(f"training curves: {curves}" if curves else "training curves: none drawn (no CSV log; logger without csv)")
    print(f"runs: {out}/<mixer>/<head>/seed<N>/ (checkpoints/, logs/ CSV, tb/ TensorBoard: tensorboard --logdir "
          f"{out}; export/model.safetensors)")
    ok, line = check_target(groups, suited, plan["target"])
    print(line)
    return 0 if ok else 1
