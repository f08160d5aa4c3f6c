"""`ssogvit main`: fixed SSoG, steered SSoG and MHA on the 8x8 digits grid, each at its own tuned setting, compared.

What it trains is data, `ssogvit/conf/main.yaml` (the plan): experiments `digits8_vit_<mixer>`
(ssogvit/conf/experiment/), each with its own head (mean-pooled for SSoG, class token for MHA, docs/models.md) and
its own learning rate and budget (chosen on the validation split by the sweep in docs/training.md, "The main job's
recipe"), each with every seed of the plan. The runs are independent processes of a stdlib `multiprocessing` pool
(`--jobs`, one torch thread each by default); each run is written to `<out>/<mixer>/<head>/seed<N>/`
(checkpoints/, logs/, export/, config.yaml). `<out>` is always a fresh folder: when `--out` (or the default
`runs/main/<date-time>`) already holds a run, `<out>-2`, `<out>-3`, ...

When every run has finished, the job reads the run folders as `ssogvit report` does and prints, under the one
comparison protocol (`ssogvit.train.comparison`): each model's test top-1 with its 95% interval over the seeds, its
plateau check and its epochs to 90% validation top-1, and each SSoG model's paired gap to MHA with its interval and
verdict; the same tables go to `<out>/comparison.md` and the curves to `<out>/curves.png`. It exits 0 whenever every
run finished, whatever the comparison shows: what the science says is printed, not asserted.
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

__all__ = ["main", "MainRun", "load_plan", "plan_runs", "HEADS"]

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
    """The main job's plan, `ssogvit/conf/main.yaml`: `runs` (`{experiment, heads}`) and `seeds`."""
    from importlib import resources

    from omegaconf import OmegaConf

    from .config import CONFIG_MODULE

    text = (resources.files(CONFIG_MODULE) / "main.yaml").read_text()
    return OmegaConf.to_container(OmegaConf.create(text), resolve=False)


def experiment_model(experiment: str) -> tuple[str, str]:
    """`(mixer, own head)` of an experiment: its `model.mixer` and `model.kwargs.global_pool` (null: the mixer's
    own head, `ssogvit.layers.default_pool`, as the model builds it)."""
    from ssogvit.layers import default_pool

    from .config import compose

    cfg = compose([f"experiment={experiment}"])
    pool = cfg.model.kwargs.get("global_pool")
    return str(cfg.model.mixer), str(default_pool(cfg.model.mixer) if pool is None else pool)


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


#: the settings the job sets for every run, and the option of `ssogvit main` that says what they are: an override of
#: one would contradict the job's own record (its folders, table and lines name the job's values)
JOB_SETS = {"experiment": "--mixers", "model.kwargs.global_pool": "--heads", "seed": "--seeds", "output_dir": "--out",
            "resume": "--out (a new folder for each job)", "progress.mode": "--no-progress",
            "logger": "the job (each run logs to CSV, which the comparison reads)"}


def check_overrides(overrides: Sequence[str], epochs: int | None) -> None:
    """Refuse an override of what the job sets for every run (`JOB_SETS`; `trainer.max_epochs` with `--epochs`),
    naming the job's option instead: it would be recorded in each run but contradict the job's folders and table."""
    from ssogvit.errors import InputError

    from .config import split_override

    owned = {**JOB_SETS, **({"trainer.max_epochs": "--epochs"} if epochs is not None else {})}
    for override in overrides:
        key = split_override(override)[0]
        if key in owned:
            raise InputError(f"{override!r}: ssogvit main sets {key} for every run itself; use {owned[key]}",
                             argument=key)


def run_overrides(run: MainRun, epochs: int | None) -> list[str]:
    """The Hydra overrides of one run: its experiment, head, seed and folder, then the user's overrides."""
    import torch

    from .config import split_override

    out = [f"experiment={run.experiment}", f"model.kwargs.global_pool={run.head}", f"seed={run.seed}",
           f"output_dir={run.folder}", "resume=null", "progress.mode=none", "logger=[csv]"]
    if epochs is not None:
        out.append(f"trainer.max_epochs={epochs}")
    if not torch.cuda.is_available() and not any(split_override(o)[0] == "trainer.accelerator" for o in run.overrides):
        out.append("trainer.accelerator=cpu")
    return out + list(run.overrides)


def _init_worker(threads: int) -> None:
    """A pool process: `threads` torch threads; Lightning's info lines, its few-workers hint (the runs are the
    parallel workers here) and a deprecation inside Lightning silenced."""
    import lightning.pytorch  # noqa: F401  (importing it sets its loggers to INFO: set them after)
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
    keep = ("model", "parameters", "metrics", "epochs", "time_s", "output_dir")
    return run, {k: summary[k] for k in keep}


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated choice of `allowed` names (`ssogvit.specs.Choice` each), in the order given, each once."""
    from ssogvit.errors import InputError
    from ssogvit.specs import Choice

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
    from ssogvit.specs import SEED, Int, Ints

    from ssogvit.errors import ArgumentParser

    at_least_one = Int(low=1).argparse
    parser = ArgumentParser(
        prog="ssogvit main",
        description="Train fixed SSoG, steered SSoG and MHA on the 8x8 grid of the embedded digits (no download), each "
        "with its own head and tuned learning rate, over three seeds in parallel processes, and print the comparison: "
        "test top-1 with 95% intervals, paired gaps with their intervals, epochs to 90% validation top-1. What it "
        "trains is ssogvit/conf/main.yaml. Extra arguments are Hydra overrides applied to every run.",
    )
    parser.add_argument("--out", default=None, help="output folder (default runs/main/<date-time>)")
    parser.add_argument("--epochs", type=at_least_one, default=None,
                        help="override every experiment's epoch count (its own converged budget)")
    parser.add_argument("--mixers", default=None, help="only these mixers, comma-separated (ssog, ssog-steered, mha)")
    parser.add_argument("--heads", default=None, help="every experiment with these heads, comma-separated: avg (mean "
                        "of the patch tokens), token (class token); default each mixer's own")
    parser.add_argument("--seeds", type=Ints(item=SEED, distinct=True).argparse, default=None,
                        help="comma-separated seeds (default the plan's: 0,1,2)")
    parser.add_argument("--jobs", type=at_least_one, default=2, help="runs trained at once, each in its own process "
                        "(default 2)")
    parser.add_argument("--threads", type=at_least_one, default=1,
                        help="torch CPU threads per run (default 1: these matrices are too small to share)")
    parser.add_argument("--no-progress", action="store_true", help="no line per finished run")
    args, overrides = parser.parse_known_args(argv)
    return report_errors("ssogvit main", lambda: _run(args, overrides))


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from ssogvit.outputs import check_output_folder

    from .config import check_run_config, compose
    from .run_folder import FolderLock, fresh_folder

    check_overrides(overrides, args.epochs)
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

    from ssogvit.outputs import atomic_write

    from .config import compose
    from .curves import plot_training_curves
    from .report import gaps_markdown, models_markdown, read_run

    cfg = compose(run_overrides(runs[0], args.epochs))
    side = cfg.data.img_size // cfg.model.kwargs.patch_size
    jobs = min(args.jobs, len(runs))
    print(f"ssogvit main: {len(runs)} runs ({', '.join(dict.fromkeys(r.mixer for r in runs))}; each its own head, "
          f"learning rate and epochs; seeds {', '.join(str(s) for s in sorted({r.seed for r in runs}))}) on "
          f"scikit-learn's digits at {cfg.data.img_size} px, patch {cfg.model.kwargs.patch_size} ({side}x{side} "
          f"tokens), {jobs} at a time with {args.threads} torch thread(s) each; writing to {out}", flush=True)
    start = time.perf_counter()
    results = []
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no state inherited from this process
    # SIGINT and SIGTERM raise `Interrupted` here (ssogvit.cli): leaving the `with` terminates the pool, so no run is
    # left training as an orphan; each run's last.ckpt is in its folder
    with context.Pool(jobs, initializer=_init_worker, initargs=(args.threads,)) as pool:
        for run, summary in pool.imap_unordered(_train_one, [(r, args.epochs) for r in runs]):
            results.append((run, summary))
            if not args.no_progress:
                m = summary["metrics"]
                print(f"[{len(results)}/{len(runs)}] {summary['model']} {run.head} seed {run.seed}: test top-1 "
                      f"{m.get('test/top1', math.nan):.2f}% (final validation {m.get('val/top1', math.nan):.2f}%, "
                      f"{summary['epochs']} epochs, {summary['time_s']:.1f} s)", flush=True)
    total = time.perf_counter() - start
    shown = [entry["experiment"] for entry in plan["runs"]]  # the plan's order
    results.sort(key=lambda item: (shown.index(item[0].experiment), HEADS.index(item[0].head)
                                   if item[0].head != suited[item[0].mixer] else -1, item[0].seed))
    logs = [read_run(summary["output_dir"]) for _, summary in results]  # what `ssogvit report` reads
    sizes = {summary["model"]: summary["parameters"] for _, summary in results}
    times = {}
    for _, summary in results:
        times.setdefault(summary["model"], []).append(summary["time_s"])
    models = ", ".join(f"{name} {n / 1e3:.1f}k parameters, {statistics.fmean(times[name]):.1f} s/run"
                       for name, n in sizes.items())
    text = f"{models_markdown(logs)}\n{gaps_markdown(logs)}"
    print(f"\n{text}\n{models}\ntotal wall time {total:.1f} s ({total / 60:.2f} min)")
    atomic_write(out / "comparison.md", lambda tmp: Path(tmp).write_text(text + f"\n{models}\n"))
    groups: dict[str, list[str]] = {}
    for run, summary in results:
        groups.setdefault(f"{summary['model']} ({run.head})", []).append(summary["output_dir"])
    seeds = sorted({r.seed for r in runs})
    curves = plot_training_curves(groups, out / "curves.png", title=f"8x8 digits grid: mean over seeds "
                                  f"{', '.join(map(str, seeds))} (band: lowest to highest seed)")
    print(f"comparison: {out / 'comparison.md'}")
    print(f"training curves: {curves}" if curves else "training curves: none drawn (no CSV log; logger without csv)")
    print(f"runs: {out}/<mixer>/<head>/seed<N>/ (checkpoints/, logs/ CSV, export/model.safetensors); `ssogvit report "
          f"{out}/*/*/seed*` redraws these tables")
    return 0
