"""`ssogvit report RUN_DIR...`: the paper's tables and training curves from the logged metrics of finished runs.

Reads what `ssogvit train` leaves in a run folder (see `ssogvit.train.run`): `config.yaml` (the resolved config, with
the experiment's `meta.rows`: the paper rows the run reproduces) and `logs/version_*/metrics.csv` (Lightning's
CSVLogger; a resumed run adds a version, and a later version's value for an epoch replaces an earlier one). Writes
into `--out`:

- `table<N>.md` for each paper table that the runs belong to (or only `--table N`): every row of the table with the
  paper's Acc@1 beside our best and final validation top-1, the dataset and the epochs run, and `runs.md` for runs
  that reproduce no paper row;
- `curves.png`: training and validation loss against epoch, every run on the same axes, and a panel per validation
  metric (top-1 of the classification runs, mIoU of the segmentation runs);
- for segmentation runs (docs/dense.md), `segmentation.md`: per experiment the final validation mIoU and pixel
  accuracy as mean ± sd over the seeds, and every seed's mIoU, and `segmentation.png` (the mean and every seed);
- for runs of CPU-sized twins of the paper's runs (experiments whose `meta.paper_experiment` names a paper run, the
  `digits8_*` family: docs/reproduction.md), `reproduction.md`: under the comparison protocol
  (`ssogvit.train.comparison`), per family and head each model's test top-1 with its 95% t interval over the seeds,
  every SSoG model's paired gap to MHA with its interval and verdict beside the paper's gap, the epochs to 90%
  validation top-1, and, for a model run with both heads, the paired gap between them; and
  `reproduction_curves.png` (the mean over the seeds of each configuration, with a band from the lowest to the
  highest seed);
- for a sweep (runs of one model at several settings), `sweep.md`: each setting's final validation top-1 and the
  chosen one.

Existing files are never overwritten unless `--overwrite` is given; the files are written together (all or none,
`ssogvit.outputs.staged_outputs`) and only after every run folder has been read.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ssogvit.errors import InputError, report_errors
from ssogvit.documents import input_folder, read_document
from ssogvit.errors import InputError
from ssogvit.specs import Int
from ssogvit.outputs import OVERWRITE_FLAG, check_output_folder, staged_outputs
from .run_folder import config_diff

if TYPE_CHECKING:
    from .comparison import Gap

__all__ = ["RunLog", "ReportError", "read_run", "table_markdown", "models_markdown", "gaps_markdown",
           "heads_markdown", "sweep_markdown", "segmentation_markdown", "plot_curves", "plot_segmentation", "main"]


class ReportError(InputError):
    """A run folder that cannot be reported, or a report that would overwrite files."""


@dataclass
class RunLog:
    """The per-epoch metrics of one run (epochs counted from 1) and what it reproduces."""

    path: Path
    name: str
    data: str
    max_epochs: int
    rows: list[dict[str, Any]]
    series: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> {epoch: value}
    family: str = ""
    mixer: str = ""
    head: str = "token"
    seed: int = 0
    paper_top1: float | None = None  # the Acc@1 of the paper's run this run is a CPU-sized twin of (meta.paper_top1)
    metric: str = "val/top1"  # what the run is scored by: val/top1, or val/miou for a segmentation run
    test: dict[str, float] = field(default_factory=dict)  # the final weights on the held-out test split, if any
    settings: dict[str, Any] = field(default_factory=dict)  # the hyper-parameters a sweep may vary (SWEPT)
    model: dict[str, Any] = field(default_factory=dict)  # the run config's model section, shared by one model's seeds
    config: dict[str, Any] = field(default_factory=dict)  # the whole run config (config.yaml)

    @property
    def epochs_done(self) -> int:
        return max(self.series.get(self.metric, {0: 0}))

    def best_top1(self) -> tuple[float, int]:
        top1 = self.series[self.metric]
        epoch = max(top1, key=lambda e: (top1[e], -e))  # the first epoch that reached the best value
        return top1[epoch], epoch

    def final_top1(self) -> float:
        top1 = self.series[self.metric]
        return top1[max(top1)]

    @property
    def test_top1(self) -> float | None:
        return self.test.get("test/top1")

    def setting(self, keys: Sequence[str] | None = None) -> str:
        """The run's hyper-parameters among `keys` (default every one of `SWEPT`) as `key=value` words."""
        return " ".join(f"{k}={v}" for k, v in self.settings.items() if keys is None or k in keys)


CURVES = ("train/loss_epoch", "val/loss", "val/top1", "val/miou", "val/pixel_acc")
TESTS = ("test/top1", "test/loss")
# The hyper-parameters that `sweep.md` tells apart (docs/training.md "How comparisons are made"): dotted keys of the
# run's config.yaml.
SWEPT = ("optim.lr", "loss.jasmin.weight", "data.batch_size", "trainer.max_epochs", "model.kwargs.global_pool")


def _dotted(cfg: dict, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def _head(model: dict[str, Any]) -> str:
    """The head a run's model section builds: its `global_pool`, or (null) the mixer's own, as `create_model` does."""
    from ssogvit.layers import default_pool

    pool = (model.get("kwargs") or {}).get("global_pool")
    return str(default_pool(str(model.get("mixer"))) if pool is None else pool)


def _check_record(path: Path) -> None:
    """The run's config.yaml (what a report labels the run by) against the model and data its sealed export (else its
    last checkpoint) records (`ssogvit.train.io.sealed_data_config`): an edited config.yaml is refused, naming the key."""
    from .io import sealed_data_config

    for sealed in (path / "export" / "model.safetensors", path / "checkpoints" / "last.ckpt"):
        if sealed.is_file():
            try:
                sealed_data_config(sealed)
            except InputError as err:
                raise ReportError(f"{path}: {err}") from None
            return


def read_run(path: str | Path) -> RunLog:
    """The logged metrics and paper rows of the run in `path` (a folder written by `ssogvit train`)."""
    path = input_folder(path, "RUN_DIR")
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise ReportError(f"{path}: no config.yaml; expected a run folder written by `ssogvit train`")
    versions = sorted((path / "logs").glob("version_*/metrics.csv"),
                      key=lambda p: int(p.parent.name.split("_")[1]) if p.parent.name[8:].isdigit() else -1)
    if not versions:
        raise ReportError(f"{path}: no logs/version_*/metrics.csv; expected a run folder written by `ssogvit train`")
    cfg = read_document(cfg_file, "config.yaml")  # bounded, never interpolated: a run folder may come from anyone
    _check_record(path)
    try:
        meta = cfg.get("meta") or {}
        rows = list(meta.get("rows") or [])
        model = cfg.get("model") or {}
        run = RunLog(path=path, name=str(cfg.get("name", path.name)), data=str(cfg["data"]["name"]),
                     max_epochs=int(cfg["trainer"]["max_epochs"]), rows=rows, family=str(model.get("family", "")),
                     mixer=str(model.get("mixer", "")),
                     head=_head(model),
                     seed=int(cfg.get("seed", 0)),
                     paper_top1=None if meta.get("paper_top1") is None else float(meta["paper_top1"]),
                     metric="val/miou" if (model.get("kwargs") or {}).get("task") == "segmentation" else "val/top1",
                     settings={k: _dotted(cfg, k) for k in SWEPT}, model=dict(model), config=dict(cfg))
        for m in rows:
            int(m["table"]), str(m["row"])
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ReportError(f"{cfg_file}: not the config of a run of `ssogvit train` ({type(err).__name__}: {err})"
                          ) from None
    for csv_file in versions:  # later launches (resume) override earlier values of the same epoch
        try:
            with open(csv_file, newline="") as f:
                for rec in csv.DictReader(f):
                    if not rec.get("epoch") or None in rec or None in rec.values():  # a line torn by a kill
                        continue
                    epoch = int(float(rec["epoch"])) + 1
                    run.test.update({k: float(rec[k]) for k in TESTS if rec.get(k) not in (None, "")})
                    for key in CURVES:
                        value = rec.get(key)
                        if value not in (None, ""):
                            run.series.setdefault(key, {})[epoch] = float(value)
        except (ValueError, UnicodeDecodeError, csv.Error) as err:
            raise ReportError(f"{csv_file}: not a metrics log written by Lightning ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not run.series.get(run.metric):
        raise ReportError(f"{path}: its metrics hold no {run.metric}; no epoch of the run has finished")
    return run


def _fmt(value: float | None) -> str:
    return "missing" if value is None else f"{float(value):.2f}"


def table_markdown(table: int | None, paper_rows: list[dict[str, Any]], runs: list[RunLog]) -> str:
    """A markdown table: each paper row with the paper's Acc@1 beside ours, or (`table=None`) the runs on their own.

    Args:
        table: the paper table number, or `None` for runs that reproduce no paper row.
        paper_rows: the table's rows (`experiment_rows(table)`); ignored when `table` is `None`.
        runs: the runs to report; a run fills the rows that its `meta.rows` names.
    """
    head = ("| Row | Experiment | Paper Acc@1 | Ours best val top-1 (epoch) | Ours final-epoch val top-1 | Data | "
            "Epochs |")  # every figure named with its split: the validation split of the raw weights (not EMA)
    lines = [head, "|---|---|---|---|---|---|---|"]

    def ours(run: RunLog) -> str:
        best, epoch = run.best_top1()
        return (f"{best:.2f} ({epoch}) | {run.final_top1():.2f} | {run.data} | {run.epochs_done}/{run.max_epochs}"
                f"{'' if run.epochs_done >= run.max_epochs else ' (unfinished)'}")

    if table is None:  # each run by its folder (seeds of one experiment share a name), its test figure where it has one
        lines[0] = lines[0].replace("| Row | Experiment | Paper Acc@1 |", "| Run | Folder | Seed |") + (
            " Final weights' test top-1 |")
        lines[1] = "|---|---|---|---|---|---|---|---|"
        lines += [f"| {run.name} | {run.path.name} | {run.seed} | {ours(run)} | {_fmt(run.test_top1)} |"
                  for run in runs]
        title = ("Runs: validation top-1 (%) of the raw weights (not EMA), the best epoch's and the final epoch's; "
                 "epochs counted from 1; the final weights' top-1 on the held-out test split where the data have "
                 "one (else missing).")
        return f"{title}\n\n" + "\n".join(lines) + "\n"
    for row in paper_rows:
        matching = [r for r in runs if any(int(m["table"]) == table and m["row"] == row["row"] for m in r.rows)]
        prefix = f"| {row['row']} | {row['experiment']} | {_fmt(row['top1'])} |"
        if not matching:
            lines.append(f"{prefix} not run | | | |")
        lines += [f"{prefix} {ours(run)} |" for run in matching]
    known = {row["row"] for row in paper_rows}
    for run in runs:  # a run that names a row the packaged configs no longer have: shown with its own record
        for m in run.rows:
            if int(m["table"]) == table and m["row"] not in known:
                lines.append(f"| {m['row']} (not in the current configs) | {run.name} | {_fmt(m.get('top1'))} "
                             f"| {ours(run)} |")
    title = (f"Table {table}: the paper's Acc@1 beside ours (validation top-1 of the raw weights, not EMA, %; epochs "
             "counted from 1).")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


GAP_MIXERS = ("mha", "ssog", "ssog-steered")


def segmentation_markdown(runs: list[RunLog]) -> str:
    """Segmentation runs per experiment: the final validation mIoU and pixel accuracy as mean ± half-width of the 95%
    t interval over the seeds (`ssogvit.train.comparison`; one seed: no interval), every seed's mIoU, and the gap of
    each experiment's mean mIoU to the best mean."""
    import statistics

    from .comparison import format_interval, interval

    groups: dict[str, list[RunLog]] = {}
    for run in sorted(runs, key=lambda r: (r.name, r.seed)):
        groups.setdefault(run.name, []).append(run)
    means = {name: statistics.fmean(r.final_top1() for r in rs) for name, rs in groups.items()}
    best = max(means.values())
    lines = ["| experiment | mixer | val mIoU | val pixel accuracy | val mIoU per seed | to the best | epochs |",
             "|---|---|---|---|---|---|---|"]
    for name, rs in sorted(groups.items(), key=lambda kv: -means[kv[0]]):
        miou = [r.final_top1() for r in rs]
        acc = [r.series["val/pixel_acc"][max(r.series["val/pixel_acc"])] for r in rs if r.series.get("val/pixel_acc")]
        seeds = ", ".join(f"{v:.2f} (seed {r.seed})" for v, r in zip(miou, rs))
        lines.append(f"| {name} | {rs[0].mixer} | {format_interval(interval(miou))} | "
                     f"{format_interval(interval(acc)) if acc else 'n/a'} | {seeds} | "
                     f"{means[name] - best:+.2f} | {rs[0].epochs_done}/{rs[0].max_epochs} |")
    title = ("Final validation mIoU and pixel accuracy (%), mean ± half-width of the 95% t interval over the seeds "
             "(one seed: no interval); 'to the best': the experiment's mean mIoU minus the best mean; the budget is "
             "the epochs column (these runs are budget-limited unless docs say otherwise).")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def plot_segmentation(runs: list[RunLog], path: Path) -> None:
    """Final validation mIoU of each segmentation experiment: a bar at the mean over the seeds, a dot per seed."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[float]] = {}
    for run in runs:
        groups.setdefault(run.name, []).append(run.final_top1())
    names = sorted(groups, key=lambda n: -statistics.fmean(groups[n]))
    fig, ax = plt.subplots(figsize=(max(1.2 * len(names) + 2, 4.6), 3.8), layout="constrained")
    ax.bar(range(len(names)), [statistics.fmean(groups[n]) for n in names], color="0.8", edgecolor="0.3")
    for i, name in enumerate(names):
        ax.plot([i] * len(groups[name]), groups[name], "o", color="C0", ms=4)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
    ax.set(ylabel="validation mIoU (%)", title="segmentation mIoU:\nmean over seeds (bar), each seed (dot)")
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _score(run: RunLog) -> float:
    """What a comparison scores a run by: its final weights' test top-1, or (no test split) its final validation."""
    return run.test_top1 if run.test_top1 is not None else run.final_top1()


#: the model keys a sweep varies (SWEPT): shown in the settings column, not a different model
_SWEPT_MODEL_KEYS = tuple(k[len("model."):] for k in SWEPT if k.startswith("model."))


def _models(runs: list[RunLog]) -> dict[tuple[str, str, str], dict[int, RunLog]]:
    """`{(family, head, mixer): {seed: run}}`, refused where one model has two runs of one seed (a sweep's runs are
    reported apart, in sweep.md), and where two runs differ in more than a comparison may (`comparison.MAY_DIFFER`:
    another data split or budget would pair scores of different experiments)."""
    from .comparison import comparison_differences

    groups: dict[tuple[str, str, str], dict[int, RunLog]] = {}
    for run in runs:
        seeds = groups.setdefault((run.family, run.head, run.mixer), {})
        if run.seed in seeds:
            other = seeds[run.seed]
            raise ReportError(f"{other.path} and {run.path}: two runs of {run.family} {run.mixer} ({run.head} head) "
                              f"with seed {run.seed} ({other.setting()} / {run.setting()}); a comparison takes one "
                              "setting per model: report the sweep's runs apart (it writes sweep.md)")
        differ = [d for r in seeds.values() for d in config_diff(r.model, run.model, ignored=_SWEPT_MODEL_KEYS,
                                                                labels=(f"{r.path.name}", f"{run.path.name}"))]
        if differ:
            other = next(iter(seeds.values()))
            raise ReportError(f"{other.path} and {run.path}: two different models of {run.family} {run.mixer} "
                              f"({run.head} head): model.{differ[0]}; a comparison averages the seeds of one model: "
                              "report them apart")
        # one comparison per family (its twins differ in the mixer only); the families share everything but the model
        first = next(r for r in runs if r.family == run.family)
        differ = comparison_differences(first.config, run.config, labels=(first.path.name, run.path.name))
        if not differ:
            first = runs[0]
            differ = [d for d in comparison_differences(first.config, run.config, labels=(first.path.name,
                                                                                         run.path.name))
                      if not d.startswith("model.")]
        if differ:
            raise ReportError(f"{first.path} and {run.path} cannot be compared: {differ[0]}; the runs of a "
                              "comparison differ only in the mixer, its head and its tuned settings (docs/training.md,"
                              " \"How comparisons are made\"): report them apart")
        seeds[run.seed] = run
    order = {"vit": 0, "looped": 1, "ode": 2}
    return dict(sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1] != "avg",
                                                        GAP_MIXERS.index(kv[0][2]) if kv[0][2] in GAP_MIXERS else 9)))


def _scored_by(runs: list[RunLog]) -> str:
    return "test top-1" if all(r.test_top1 is not None for r in runs) else "final validation top-1"


def models_markdown(runs: list[RunLog]) -> str:
    """Each model (family, head, mixer) under the comparison protocol (`ssogvit.train.comparison`): its score (test
    top-1 of the final weights) as the mean with a 95% t interval over its seeds and every seed, its settings,
    how many of its runs reached the plateau, and its epochs to `SPEED_TOP1` % validation top-1."""
    from .comparison import SPEED_TOP1, epochs_to, format_interval, interval, reached_plateau

    scored = _scored_by(runs)
    lines = [f"| family | head | mixer | {scored} % | {scored} per seed | settings | plateau | "
             f"epochs to {SPEED_TOP1:.0f}% val |",
             "|---|---|---|---|---|---|---|---|"]
    for (family, pool, mixer), seeds in _models(runs).items():
        rs = [seeds[s] for s in sorted(seeds)]
        per_seed = ", ".join(f"{_score(r):.2f}" for r in rs)
        settings = sorted({r.setting() for r in rs})
        plateau = sum(reached_plateau(r.series["val/top1"]) for r in rs)
        speed = [epochs_to(r.series["val/top1"]) for r in rs]
        never = sum(1 for v in speed if v != v)
        speed_text = format_interval(interval(speed), digits=1) + (f" ({never} never)" if never else "")
        lines.append(f"| {family} | {pool} | {mixer} | {format_interval(interval([_score(r) for r in rs]))} | "
                     f"{per_seed} | {'; '.join(settings)} | {plateau}/{len(rs)} | {speed_text} |")
    title = (f"Each model's {scored} (%) as mean ± half-width of the 95% t interval over its seeds, every seed "
             "(in seed order), its settings, how many runs reached the plateau (the last fifth of the epochs added "
             "under 0.5 points of validation top-1), and the epochs to 90% validation top-1.")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def _paired_gaps(a: dict[int, RunLog], b: dict[int, RunLog]) -> tuple[Gap, Gap]:
    """Two models' runs by seed, paired: the score gap `a - b` and the learning-speed gap, the epochs to
    `SPEED_TOP1` % validation top-1 of `b` minus those of `a` (positive: `a` sooner)."""
    from .comparison import epochs_to, paired_gap

    gap = paired_gap({s: _score(r) for s, r in a.items()}, {s: _score(r) for s, r in b.items()})
    speed = paired_gap({s: epochs_to(r.series["val/top1"]) for s, r in b.items()},
                       {s: epochs_to(r.series["val/top1"]) for s, r in a.items()})
    return gap, speed


def gaps_markdown(runs: list[RunLog]) -> str:
    """Every SSoG model against its MHA twin under the comparison protocol: the paired mean difference of the
    scores over shared seeds with its 95% t interval, every seed's difference, the verdict ("leads" / "trails" only
    where the interval excludes zero), and the paper's gap (from each run's `meta.paper_top1`) where it has one.
    Within one head (both heads where both were run), and each mixer with its own head (SSoG: mean of the patch
    tokens, MHA: class token, docs/models.md)."""
    from .comparison import format_interval

    models = _models(runs)
    pairs = []  # (family, heads label, ssog key, mha key)
    for family, pool, mixer in models:
        if mixer in ("ssog", "ssog-steered") and (family, pool, "mha") in models:
            pairs.append((family, pool, (family, pool, mixer), (family, pool, "mha")))
    for family, pool, mixer in models:
        if mixer in ("ssog", "ssog-steered") and pool == "avg" and (family, "token", "mha") in models:
            pairs.append((family, "own (avg vs token)", (family, pool, mixer), (family, "token", "mha")))
    scored = _scored_by(runs)
    lines = [f"| family | heads | comparison | {scored} gap (points) | gap per seed | verdict | paper | epochs to 90% "
             "val: mha - ssog |", "|---|---|---|---|---|---|---|---|"]
    for family, heads, a, b in pairs:
        ra, rb = models[a], models[b]
        gap, speed = _paired_gaps(ra, rb)
        pa, pb = next(iter(ra.values())).paper_top1, next(iter(rb.values())).paper_top1
        paper = f"{pa - pb:+.2f}" if pa is not None and pb is not None else "n/a"
        per_seed = ", ".join(f"{d:+.2f}" for d in gap.per_seed)
        lines.append(f"| {family} | {heads} | {a[2]} - mha | **{format_interval(gap.interval, signed=True)}** | "
                     f"{per_seed} | {a[2]} {gap.verdict} | {paper} | "
                     f"{format_interval(speed.interval, signed=True, digits=1)} |")
    title = (f"Gaps in {_scored_by(runs)}: paired by seed, mean ± half-width of the 95% t interval; 'leads' / "
             "'trails' only where the interval excludes zero. 'paper': the paper's CIFAR-100 gap at D=768 for the "
             "runs these are the CPU-sized twins of. Learning speed: how many epochs later MHA's run of a seed "
             "reaches 90% validation top-1 than the SSoG run of that seed (paired over the seeds where both do; "
             "positive: SSoG sooner).")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def heads_markdown(runs: list[RunLog]) -> str:
    """Each model run with both heads, at one setting: the paired difference `avg - token` of the scores over shared
    seeds with its 95% t interval, every seed's difference and the verdict, and the same for the epochs to
    `SPEED_TOP1` % validation top-1 (`token - avg`: positive, the mean-pooled head sooner). Empty (no rows) where no
    model has both heads. This is the measurement behind the default head (docs/models.md, "The default head")."""
    from .comparison import format_interval

    models = _models(runs)
    lines = [f"| family | mixer | {_scored_by(runs)}, avg - token (points) | gap per seed | verdict | epochs to 90% "
             "val: token - avg |",
             "|---|---|---|---|---|---|"]
    for family, pool, mixer in models:
        if pool != "avg" or (family, "token", mixer) not in models:
            continue
        gap, speed = _paired_gaps(models[(family, "avg", mixer)], models[(family, "token", mixer)])
        verdict = {"leads": "avg leads", "trails": "token leads"}.get(gap.verdict, gap.verdict)
        lines.append(f"| {family} | {mixer} | **{format_interval(gap.interval, signed=True)}** | "
                     f"{', '.join(f'{d:+.2f}' for d in gap.per_seed)} | {verdict} | "
                     f"{format_interval(speed.interval, signed=True, digits=1)} |")
    title = (f"Heads, where a model ran with both at one setting: {_scored_by(runs)} with the mean of the patch "
             "tokens (avg) minus with the class token (token), paired by seed, mean ± half-width of the 95% t "
             "interval; a lead only where the interval excludes zero.")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def sweep_markdown(runs: list[RunLog]) -> str:
    """A hyper-parameter sweep, per experiment and head: each setting's final validation top-1 (mean ± 95% t
    interval over its seeds), how many of its runs reached the plateau, and the chosen setting (the best mean;
    test numbers are not shown here: they take no part in the choice)."""
    from .comparison import format_interval, interval, reached_plateau

    varying = [k for k in SWEPT if len({repr(r.settings.get(k)) for r in runs}) > 1]  # what the sweep varies
    groups: dict[tuple[str, str], dict[str, list[RunLog]]] = {}
    for run in runs:
        groups.setdefault((run.name, run.head), {}).setdefault(run.setting(varying), []).append(run)
    lines = ["| experiment | head | setting | final val top-1 % | seeds | plateau | chosen |",
             "|---|---|---|---|---|---|---|"]
    for (name, pool), settings in sorted(groups.items()):
        means = {k: interval([r.final_top1() for r in rs]) for k, rs in settings.items()}
        best = max(means, key=lambda k: means[k].mean)
        for k, rs in sorted(settings.items()):
            plateau = sum(reached_plateau(r.series["val/top1"]) for r in rs)
            lines.append(f"| {name} | {pool} | {k} | {format_interval(means[k])} | "
                         f"{', '.join(str(r.seed) for r in sorted(rs, key=lambda r: r.seed))} | {plateau}/{len(rs)} | "
                         f"{'**chosen**' if k == best and len(settings) > 1 else ''} |")
    title = ("A sweep: each setting's final validation top-1 (the split that chooses; the test split takes no part), "
             "mean ± half-width of the 95% t interval over its seeds; the chosen setting has the best mean.")
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def _is_sweep(runs: list[RunLog]) -> bool:
    """Whether the runs of some experiment and head differ in a swept hyper-parameter."""
    seen: dict[tuple[str, str], set[str]] = {}
    for run in runs:
        seen.setdefault((run.name, run.head), set()).add(run.setting())
    return any(len(v) > 1 for v in seen.values())


def plot_curves(runs: list[RunLog], path: Path) -> None:
    """Loss (training solid, validation dashed) against epoch, every run on the same axes, and one panel per
    validation metric the runs are scored by (top-1 for classification, mIoU for segmentation: never one axis for
    two metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    scores = sorted({run.metric for run in runs}, key=lambda m: (m != "val/top1", m))
    fig, axes = plt.subplots(1, 1 + len(scores), figsize=(5.5 * (1 + len(scores)), 4.2), layout="constrained")
    ax_loss, score_axes = axes[0], dict(zip(scores, axes[1:]))
    colors = plt.get_cmap("tab10")
    for i, run in enumerate(runs):
        c = colors(i % 10)
        for key, style in (("train/loss_epoch", "-"), ("val/loss", "--")):
            s = run.series.get(key, {})
            if s:
                ax_loss.plot(sorted(s), [s[e] for e in sorted(s)], style, color=c, marker="o", ms=3)
        s = run.series[run.metric]
        score_axes[run.metric].plot(sorted(s), [s[e] for e in sorted(s)], "-", color=c, marker="o", ms=3,
                                    label=run.name)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_loss.legend(handles=[Line2D([], [], color="k", ls="-", label="training"),
                            Line2D([], [], color="k", ls="--", label="validation")])
    for metric, ax in score_axes.items():
        name = {"val/top1": "top-1", "val/miou": "mIoU"}.get(metric, metric.removeprefix("val/"))
        ax.set(xlabel="epoch", ylabel=f"validation {name} (%)", title=f"validation {name}")
        ax.legend(fontsize="small")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """`ssogvit report RUN_DIR... [--table N] [--out DIR] [--force]`"""
    from .cli import ArgumentParser

    parser = ArgumentParser(
        prog="ssogvit report",
        description="Write the markdown table of a paper table (our validation top-1 beside the paper's Acc@1) and "
        "PNG training curves from the logged metrics of runs written by `ssogvit train`.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (output_dir of `ssogvit train`)")
    parser.add_argument("--table", type=Int(1, 1000).argparse, default=None,
                        help="only this paper table (every run must belong to it)")
    parser.add_argument("--out", default="report", help="folder for the tables and curves.png (default: report)")
    parser.add_argument(OVERWRITE_FLAG, action="store_true", help="replace files already in --out")
    args = parser.parse_args(argv)

    def run() -> int:
        for p in _report(args):
            print(f"wrote {p}")
        return 0

    return report_errors("ssogvit report", run)


#: the names of every file a report writes (`_report`): a folder holding one this report does not write is refused
REPORT_FILE = re.compile(r"(table\d+|segmentation|runs|sweep|reproduction)\.md"
                         r"|(segmentation|reproduction_curves|curves)\.png")


def _report(args: argparse.Namespace) -> list[Path]:
    from .config import experiment_rows

    seen: dict[Path, str] = {}
    for p in args.runs:  # one run once, however it is spelled (a link, a trailing slash)
        where = Path(p).expanduser().resolve()
        if where in seen:
            raise ReportError(f"{p} is the run {seen[where]} again; give each run once")
        seen[where] = str(p)
    runs = [read_run(p) for p in args.runs]
    tables = sorted({int(m["table"]) for r in runs for m in r.rows})
    if args.table is not None:
        outside = [r.name for r in runs if not any(int(m["table"]) == args.table for m in r.rows)]
        if outside:
            raise ReportError(f"run(s) {', '.join(outside)} reproduce no row of Table {args.table} (their config's "
                              "meta.rows); leave out --table to report every table they belong to")
        tables = [args.table]
    outputs: dict[Path, Any] = {}  # text, None (curves.png), ("segmentation", runs), or twins (reproduction_curves)
    out = check_output_folder(args.out, "--out")
    for t in tables:
        outputs[out / f"table{t}.md"] = table_markdown(t, experiment_rows(t), runs)
    dense = [r for r in runs if r.metric == "val/miou"]
    if dense and args.table is None:
        outputs[out / "segmentation.md"] = segmentation_markdown(dense)
        outputs[out / "segmentation.png"] = ("segmentation", dense)
    loose = [r for r in runs if not r.rows and r.metric != "val/miou"]
    if loose and args.table is None:
        outputs[out / "runs.md"] = table_markdown(None, [], loose)
    classified = [r for r in runs if r.metric == "val/top1"]
    if classified and args.table is None and _is_sweep(classified):
        outputs[out / "sweep.md"] = sweep_markdown(classified)
    twins = [r for r in classified if r.paper_top1 is not None]
    if twins and args.table is None and not _is_sweep(twins):
        outputs[out / "reproduction.md"] = "\n".join([models_markdown(twins), gaps_markdown(twins),
                                                      heads_markdown(twins)])
        outputs[out / "reproduction_curves.png"] = twins
    outputs[out / "curves.png"] = None
    stale = sorted(p.name for p in out.iterdir() if REPORT_FILE.fullmatch(p.name) and p not in outputs
                   ) if out.is_dir() else []
    if stale:  # replaced or not, they would stand beside this report as if part of it
        raise ReportError(f"{out} holds {', '.join(stale)} of an earlier report, which this one does not write: the "
                          "folder would mix two reports; move them away or choose another --out", argument="--out")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not args.overwrite:
        raise ReportError(f"{', '.join(existing)} already exist; pass {OVERWRITE_FLAG} to replace them or choose "
                          "another --out", argument="--out")
    with staged_outputs(out, "--out", overwrite=args.overwrite) as stage:
        for p, text in outputs.items():
            if text is None:
                plot_curves(runs, stage / p.name)
            elif isinstance(text, tuple):
                plot_segmentation(text[1], stage / p.name)
            elif isinstance(text, list):
                _plot_twin_curves(text, stage / p.name)
            else:
                (stage / p.name).write_text(text)
    return list(outputs)


def _plot_twin_curves(runs: list[RunLog], path: Path) -> None:
    """Each (family, mixer, head) of the twins as the mean of its seeds, with a lowest-to-highest band."""
    from .curves import plot_training_curves

    groups: dict[str, list[Path]] = {}
    for run in sorted(runs, key=lambda r: (r.family, GAP_MIXERS.index(r.mixer) if r.mixer in GAP_MIXERS else 9)):
        groups.setdefault(f"{run.family} {run.mixer} ({run.head})", []).append(run.path)
    plot_training_curves(groups, path, title="CPU-sized twins of the paper's runs: mean over seeds (band: range)",
                         overwrite=True,  # a fresh staging folder: `_report` has refused existing files unless asked
                         row_of=lambda label: label.split()[0])  # a row of panels per family
