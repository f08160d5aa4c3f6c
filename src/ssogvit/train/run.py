"""One training run from a composed config: data, model, Lightning trainer, checkpoints, export, summary.

Layout of `<output_dir>` (default `runs/<name>`), which belongs to one run (`ssogvit.train.run_folder`):

    config.yaml                 the composed, resolved config of the run
    run.json                    "running" or "finished" (after the final checkpoint and export)
    .lock                       held by the live run (fcntl.flock, released by the OS when it exits or dies)
    checkpoints/last.ckpt       the state at the end of each training epoch, and the final state: what resumes
    checkpoints/best.ckpt       best `ckpt.monitor` so far (saved at validation; for evaluation, not for resuming)
    checkpoints/step=*.ckpt     the `ckpt.keep` most recent mid-epoch snapshots (for evaluation, not for resuming)
    logs/version_*/metrics.csv  CSV log (one version per launch; a resume drops the rows it will log again)
    tb/version_*/               TensorBoard log
    export/model.safetensors    final weights, config beside it in model.json (+ model_ema.* with EMA)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .components import build_callbacks, build_loggers, progress_callbacks
from .config import check_run_config, model_config_from, split_override
from .hydra_app import task_overrides
from ssogvit.outputs import OutputError, check_output_folder

from .errors import ConfigError
from .io import atomic_checkpoint_io, check_checkpoint, count_parameters, read_model_config, write_export
from .module import ClassificationModule
from .segmentation import SegmentationModule
from .resume import EpochEndCheckpoint, check_resumable, epochs_done, save_resumable
from .run_folder import RESUME_WORDS, RunFolder, fresh_folder, prune_logs

__all__ = ["train", "build_trainer", "log_interval", "build_datamodule", "fit", "resolve_precision", "resolve_resume",
           "format_summary"]

NO_RESUME = (None, False, "null", "none", "false")


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`auto` becomes `16-mixed` on CUDA and `32-true` elsewhere; mixed precision is a GPU-only setting here, so a
    mixed precision asked for without a GPU is a `ConfigError` (Lightning would switch `16-mixed` to `bf16-mixed` on
    the CPU and the first optimiser step would fail, after the run had begun)."""
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    if str(precision) == "auto":
        return "16-mixed" if on_gpu else "32-true"
    if "mixed" in str(precision) and not on_gpu:
        raise ConfigError(f"trainer.precision={precision}: mixed precision needs a GPU (trainer.accelerator="
                          f"{accelerator}{'' if torch.cuda.is_available() else ', no CUDA here'}); on the CPU use "
                          "32-true, or leave it auto")
    return str(precision)


def build_datamodule(cfg: DictConfig):
    from ssogvit.data import create_datamodule

    options = OmegaConf.to_container(cfg.data, resolve=True)
    return create_datamodule(options.pop("name"), **options)


def resolve_resume(cfg: DictConfig, ckpt_dir: Path) -> str | None:
    """The checkpoint to resume from (`resume: auto` or `extend` -> `last.ckpt` if present), checked to be readable."""
    resume = cfg.resume
    if resume in (*NO_RESUME, "new"):
        return None
    auto = resume in ("auto", "extend")
    path = ckpt_dir / "last.ckpt" if auto else Path(str(resume))
    if auto and not path.exists():
        return None
    check_checkpoint(path)  # a clear CheckpointError naming the intact ones, instead of a zip error mid-restore
    return str(path)


def log_interval(cfg: DictConfig, batches: int | None) -> int:
    """`trainer.log_every_n_steps`, lowered to the training batches of an epoch (`batches` batches in the loader, as
    `trainer.limit_train_batches` cuts them) when there are fewer: a small dataset is then logged once an epoch
    instead of Lightning warning that it never is (docs/training.md, "What a run prints")."""
    every = int(cfg.trainer.log_every_n_steps)
    if not batches:
        return every
    limit = cfg.trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = max(1, int(batches * limit))
    return max(1, min(every, batches))


def build_trainer(cfg: DictConfig, output_dir: Path, *, callbacks: list | None = None, loggers: bool = True,
                  train_batches: int | None = None):
    """The Lightning `Trainer` for a run config, with checkpointing into `output_dir/checkpoints`; `train_batches`
    (the training loader's length, when known) lowers the logging interval to it (`log_interval`)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    ckpt_dir = output_dir / "checkpoints"
    every = cfg.ckpt.every_n_train_steps
    # Each file is written to a temporary file in the same folder and renamed over the old one (atomic_checkpoint_io),
    # so a kill never leaves a torn file.
    cbs = [
        # best.ckpt (by ckpt.monitor) at each validation
        ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=str(cfg.ckpt.monitor), mode="max", save_top_k=1,
                        auto_insert_metric_name=False, enable_version_counter=False),
        EpochEndCheckpoint(ckpt_dir / "last.ckpt"),  # after validation: the only checkpoints a resume uses
    ]
    if every:  # mid-epoch snapshots, the ckpt.keep most recent (not resumable: see ClassificationModule)
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step={step:07d}", auto_insert_metric_name=False,
                                   monitor="step", mode="max", save_top_k=int(cfg.ckpt.keep),
                                   every_n_train_steps=int(every), enable_version_counter=False))
    logger: Any = build_loggers(cfg, output_dir) if loggers else []  # `logger`: csv, tensorboard, wandb, mlflow
    if logger:
        cbs.append(LearningRateMonitor(logging_interval="step"))
    show_bar, progress = progress_callbacks(cfg)  # Lightning's bar on a terminal, else lines (`progress`)
    cbs += build_callbacks(cfg) + progress + list(callbacks or [])
    t.pop("logger", None)
    t["enable_progress_bar"] = show_bar
    accelerator = str(t.pop("accelerator"))
    precision = resolve_precision(t.pop("precision"), accelerator)
    limits = {k: t.pop(k) for k in ("limit_train_batches", "limit_val_batches") if t.get(k) is not None}
    t = {k: v for k, v in t.items() if k not in ("limit_train_batches", "limit_val_batches")}
    t["log_every_n_steps"] = log_interval(cfg, train_batches)
    return pl.Trainer(accelerator=accelerator, precision=precision, callbacks=cbs, logger=logger or False,
                      default_root_dir=str(output_dir), plugins=[atomic_checkpoint_io()], **limits, **t)


def _run_model_config(cfg: DictConfig, dm) -> dict[str, Any]:
    src = cfg.transfer.ckpt
    if not src:
        config = model_config_from(cfg)
        if config.get("num_classes") is None:  # data.num_classes null (imagefolder): the classes the data have
            config["num_classes"] = int(dm.num_classes)
        return config
    config = read_model_config(src)  # the source architecture, with a new head for the target classes
    _refuse_contradicting_model(cfg, config, src)
    config["num_classes"] = int(dm.num_classes)
    if int(config.get("in_chans", 3)) != int(dm.in_chans):
        raise ConfigError(f"source model takes {config.get('in_chans', 3)} channels, the target data has {dm.in_chans}")
    return config


def _refuse_contradicting_model(cfg: DictConfig, source: dict[str, Any], src: Any) -> None:
    """A transfer builds the source's architecture (``source``): a ``model.*`` override that says otherwise would be
    recorded in config.yaml and ignored, so it is refused, naming the key and both values (the head's class count
    is the data's, and a new one)."""
    wanted = model_config_from(cfg)
    for override in task_overrides():
        key = split_override(override)[0]
        if key.split(".")[0] != "model":
            continue
        name = key.split(".", 2)[2] if key.startswith("model.kwargs.") else "name"
        if name == "num_classes" or name not in wanted:
            continue
        given, saved = wanted[name], source.get(name)
        if json.dumps(given, default=str) != json.dumps(saved, default=str):
            raise ConfigError(f"{override!r} contradicts the transfer's source (transfer.ckpt={src}), built with "
                              f"{'model' if name == 'name' else name}={saved!r}: a transfer trains the source's "
                              "architecture with a new head; leave the override out")


def _is_global_zero() -> bool:
    """Rank 0 of a distributed launch (torchrun, SLURM, Lightning's own launcher), read from the environment."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0) == 0


def _prepare(cfg: DictConfig, callbacks: list | None) -> tuple[Any, Any, dict[str, Any], ClassificationModule]:
    """Everything a launch needs, checked before it writes anything: the config's values, the data (found, loaders
    built), the model (built, and one forward pass on a blank image of the data's shape), and how to build the
    trainer (called once the run folder's decision is checked: Lightning prints its banner as it builds one).

    Returns `(make_trainer, datamodule, model_config, module)`; a `ConfigError` or `DataError` names what is wrong.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ssogvit.data import DataError

    def refuse(what: str, err: BaseException) -> ConfigError:
        return ConfigError(f"{what}: {(str(err).splitlines() or [type(err).__name__])[0]}")

    output_dir = Path(str(cfg.output_dir)).expanduser()
    try:  # a file where the folder belongs, a folder that cannot be written or created
        check_output_folder(output_dir, "output_dir", run=True)
    except OutputError as err:
        raise ConfigError(str(err)) from None
    try:
        dm = build_datamodule(cfg)
    except (ValueError, TypeError) as err:  # an option the dataset does not take, a value it refuses
        raise refuse("the data cannot be set up from this config", err) from None
    dm.prepare_data()  # a missing dataset fails here, with its help text, before any model is built
    if int(dm.num_classes) <= 0:
        raise DataError("the dataset has no classes: set data.num_classes or data.root")
    model_config = _run_model_config(cfg, dm)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {k: recipe[k] for k in ("optim", "sched", "loss", "mixup", "ema")}
    recipe["batch_size"] = int(cfg.data.batch_size)
    transfer = OmegaConf.to_container(cfg.transfer, resolve=True) if cfg.transfer.ckpt else None
    task = _check_task(cfg, dm, model_config)
    if task == "segmentation":
        recipe["ignore_index"] = int(dm.ignore_index)
    try:
        module = (SegmentationModule if task == "segmentation" else ClassificationModule)(
            model_config, recipe, transfer, OmegaConf.to_container(cfg.data, resolve=True))
    except (ValueError, TypeError, RuntimeError) as err:  # an option the model does not take, a value it refuses
        raise refuse("the model cannot be built from this config", err) from None
    try:  # after the model, as Lightning does it: a dataset drawing random numbers leaves the initial weights alone
        dm.setup("fit")
        loader = dm.train_dataloader()
        dm.val_dataloader()
    except (ValueError, TypeError) as err:
        raise refuse("the data loaders cannot be built from this config", err) from None
    try:
        train_batches = len(loader)
    except TypeError:  # an iterable dataset: Lightning cannot tell either
        train_batches = None
    blank = torch.zeros(1, int(dm.in_chans), int(dm.img_size), int(dm.img_size))  # (1, C, H, W)
    training = module.training
    try:
        with torch.inference_mode():  # eval mode: no dropout, no drop path, so no random number is drawn
            module.eval()(blank)
    except (ValueError, RuntimeError) as err:
        raise refuse(f"the model cannot run on {dm.img_size} px images with {dm.in_chans} channels", err) from None
    finally:
        module.train(training)

    def make_trainer() -> Any:
        try:
            return build_trainer(cfg, output_dir, callbacks=callbacks, train_batches=train_batches)
        except (ValueError, TypeError, ImportError, MisconfigurationException) as err:
            raise refuse("the trainer cannot be set up from this config", err) from None

    return make_trainer, dm, model_config, module


def _check_task(cfg: DictConfig, dm, model_config: dict[str, Any]) -> str:
    """The run's task (`classification` or `segmentation`), the same for the data and the model, and monitored by a
    metric of that task (`ckpt.monitor`); a `ConfigError` says what does not fit."""
    data_task = getattr(dm, "task", "classification")
    model_task = model_config.get("task") or "classification"
    if data_task != model_task and cfg.transfer.ckpt:  # the source's architecture, task included, is what trains
        raise ConfigError(f"data={cfg.data.name} is a {data_task} dataset but transfer.ckpt={cfg.transfer.ckpt} is a "
                          f"{model_task} model, and a transfer keeps its source's task: transfer it to {model_task} "
                          f"data, or train a {data_task} model")
    if data_task != model_task:
        raise ConfigError(f"data={cfg.data.name} is a {data_task} dataset but the model is a {model_task} model: set "
                          f"model.kwargs.task={'segmentation' if data_task == 'segmentation' else 'null'}")
    metric = str(cfg.ckpt.monitor).split("/")[-1]
    seg_metric = metric in ("miou", "pixel_acc")
    if seg_metric != (data_task == "segmentation"):
        raise ConfigError(f"ckpt.monitor={cfg.ckpt.monitor} is not a metric of {data_task}: use "
                          f"{'val/miou' if data_task == 'segmentation' else 'val/top1'}")
    return data_task


def train(cfg: DictConfig, *, callbacks: list | None = None, verbose: bool = True) -> dict[str, Any]:
    """Train (or resume) the run described by `cfg`; returns its summary (metrics, parameters, time, paths).

    Before anything is written the launch is checked: the data are found, the model builds, and the output folder
    holds no run, or the unfinished run of this same config (resumed from its `last.ckpt` with `resume: auto`), or
    `resume` names a checkpoint taken at an epoch end (`ssogvit.train.resume.check_resumable`); otherwise a
    `TrainError` says what to do.
    A non-finite loss or weights stop the run with a `NonFiniteError`; nothing non-finite is saved or exported.

    Seeds with `seed_everything(cfg.seed, workers=True)` and checkpoints the RNG states: with `trainer.deterministic`
    (default true), on one machine with the same threads and workers, two runs with the same seed, or a run killed
    and resumed any number of times, end with bit-identical weights.
    """
    start = time.perf_counter()
    deterministic_before = torch.are_deterministic_algorithms_enabled()  # Trainer(deterministic=True) switches it on
    try:
        with warnings.catch_warnings():  # Lightning 2.6 on torch 2.14 warns of its own use of torch's pytree API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            return _launch(cfg, callbacks, verbose, start)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)


def _launch(cfg: DictConfig, callbacks: list | None, verbose: bool, start: float) -> dict[str, Any]:
    import lightning.pytorch as pl

    check_run_config(cfg)  # before seed_everything reads the seed
    if cfg.resume == "new":
        _new_try(cfg)
    output_dir = Path(str(cfg.output_dir)).expanduser()
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    make_trainer, dm, model_config, module = _prepare(cfg, callbacks)
    config = OmegaConf.to_container(cfg, resolve=True)
    resume_setting = cfg.resume
    same_run = dict(model_config=module.hparams["model_config"], recipe=module.hparams["recipe"], config=config,
                    resume=resume_setting)
    if resume_setting not in (*NO_RESUME, *RESUME_WORDS):
        check_resumable(resume_setting, **same_run)  # an explicit path: readable, ours, this run's

    if not _is_global_zero():  # rank 0 owns the folder; the other ranks follow its (already checked) decision
        return _fit(cfg, output_dir, make_trainer(), dm, model_config, module,
                    resolve_resume(cfg, output_dir / "checkpoints"), start)
    folder = RunFolder(output_dir, command="transfer" if cfg.transfer.ckpt else "train")
    planned = folder.decide_resume(resume_setting, config)  # refused here, nothing is written (not even the lock)
    checked = check_resumable(planned, **same_run) if planned else None
    trainer = make_trainer()  # after every refusal: its banner belongs to a run that goes ahead
    with folder.claim(resume_setting, config) as resume:
        epoch, step, done, finished = -1, 0, 0, None
        if resume is not None:
            ckpt = checked if resume == planned else check_resumable(resume, **same_run)
            epoch, step, done = int(ckpt.get("epoch", -1)), int(ckpt.get("global_step", 0)), epochs_done(ckpt)
            finished = _finished_record(cfg, output_dir, ckpt, done, step, start)
            del ckpt
        del checked
        prune_logs(output_dir, epoch=epoch, step=step)
        folder.begin(lambda tmp: OmegaConf.save(cfg, tmp, resolve=True), resumed_from=resume)
        if finished is not None:  # killed after its final checkpoint and export, before run.json said so
            if verbose:
                print(f"{resume} holds the run's whole budget ({done} epochs) and its export is written: the run had "
                      "finished; nothing is trained or rewritten")
            folder.write_state("finished", epochs=finished["epochs"], steps=finished["steps"], best=finished["best"],
                               export=finished["export"])
            return finished
        if verbose and resume:
            print(f"resuming from {resume} ({done} epochs done, step {step})")
        summary = _fit(cfg, output_dir, trainer, dm, model_config, module, resume, start)
        folder.write_state("finished", epochs=summary["epochs"], steps=summary["steps"], best=summary["best"],
                           export=summary["export"])
    if verbose:
        print(format_summary(summary))
    return summary


def _finished_record(cfg: DictConfig, output_dir: Path, ckpt: dict[str, Any], done: int, step: int,
                     start: float) -> dict[str, Any] | None:
    """The summary of a run whose resume checkpoint holds its whole budget (`trainer.max_epochs`, or `max_steps`) and
    whose export was written after it, read from them; None otherwise. Fitting again would train nothing and then
    rewrite the export without the metrics only training logs (its train and validation figures)."""
    from .io import sealed_record

    max_epochs, max_steps = cfg.trainer.get("max_epochs"), cfg.trainer.get("max_steps")
    budget = (max_epochs is not None and int(max_epochs) > 0 and done >= int(max_epochs)) or (
        max_steps is not None and int(max_steps) > 0 and step >= int(max_steps))
    export, last = output_dir / "export" / "model.safetensors", output_dir / "checkpoints" / "last.ckpt"
    if not budget or not cfg.export.safetensors or not export.is_file() or not last.is_file():
        return None
    if export.stat().st_mtime < last.stat().st_mtime:  # the export is an earlier one's: finish the run anew
        return None
    record = sealed_record(export) or {}
    best = None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if str(key).startswith("ModelCheckpoint") and isinstance(state, dict) and \
                state.get("monitor") == str(cfg.ckpt.monitor) and state.get("best_model_score") is not None:
            best = float(state["best_model_score"])
    return {"name": str(cfg.name), "model": (record.get("model_config") or {}).get("name"),
            "metrics": dict(record.get("metrics") or {}), "epochs": done, "steps": step, "best": best,
            "monitor": str(cfg.ckpt.monitor), "time_s": time.perf_counter() - start, "output_dir": str(output_dir),
            "checkpoints": str(output_dir / "checkpoints"), "last_ckpt": str(last), "logs": str(output_dir / "logs"),
            "tensorboard": str(output_dir / "tb"), "export": str(export)}


#: the folder rank 0 chose for `resume=new`, for the processes Lightning's launcher starts after it (DDP)
NEW_TRY_ENV = "SSOGVIT_NEW_TRY_DIR"


def _new_try(cfg: DictConfig) -> None:
    """`resume=new`: a new try of the experiment in `output_dir` if it holds no run, else in the first free folder
    beside it (`runs/<name>-2`, `-3`, ...), as a fresh start (docs/training.md, "A run folder belongs to one run")."""
    asked = Path(str(cfg.output_dir)).expanduser()
    chosen = os.environ.get(NEW_TRY_ENV) if not _is_global_zero() else None
    out = Path(chosen) if chosen else fresh_folder(asked)
    if out != asked and _is_global_zero():
        print(f"{asked} holds a run; this new try writes to {out}", flush=True)
    os.environ[NEW_TRY_ENV] = str(out)
    cfg.output_dir, cfg.resume = str(out), None


class _QuietSignals(logging.Filter):
    """Drops Lightning's own lines about a signal (`Received SIGTERM`, `Detected KeyboardInterrupt`): `fit` says it
    in one line of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("Received SIGTERM" in text or "Detected KeyboardInterrupt" in text)


def fit(trainer, module, dm, resume: str | None, output_dir: Path) -> None:
    """`trainer.fit`, ending with one line when SIGINT or SIGTERM stops it (`ssogvit.errors.Interrupted`: what the
    folder holds and how to go on); Lightning's own ending there is `sys.exit(1)` or a traceback."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ssogvit.errors import Interrupted

    signum = None
    quiet = _QuietSignals()
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch.trainer.connectors.signal_connector",
                                                "lightning.pytorch.utilities.rank_zero")]
    for log in loggers:
        log.addFilter(quiet)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True)
    except Interrupted as err:
        signum = err.signum
    except SIGTERMException:
        signum = signal.SIGTERM
    except SystemExit:  # Lightning's ending of a KeyboardInterrupt (our `Interrupted`) during fit
        if not trainer.interrupted:
            raise
        signum = signal.SIGTERM if trainer.received_sigterm else signal.SIGINT
    finally:
        for log in loggers:
            log.removeFilter(quiet)
    if signum is None and not trainer.interrupted:
        return
    last = output_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        from .io import read_checkpoint

        epochs = int(read_checkpoint(last, mmap=True).get("epoch", -1)) + 1  # saved at the end of that epoch
        detail = (f"{last} ({epochs} epoch(s) done) resumes the run exactly: launch the same command again "
                  "(resume=auto)")
    else:
        detail = f"no epoch of the run in {output_dir} had ended: launching the same command again starts it afresh"
    raise Interrupted(int(signum or signal.SIGINT), detail)


def _fit(cfg: DictConfig, output_dir: Path, trainer, dm, model_config: dict[str, Any], module: ClassificationModule,
         resume: str | None, start: float) -> dict[str, Any]:
    fit(trainer, module, dm, resume, output_dir)
    save_resumable(trainer, output_dir / "checkpoints" / "last.ckpt")  # the final state, whatever saved last

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    if dm.has_test:  # the held-out split, read once, by the final weights (docs/training.md "How comparisons are made")
        tested = trainer.test(module, datamodule=dm, verbose=False)[0]
        metrics.update({k: float(v) for k, v in tested.items()})
    best_cb = next(cb for cb in trainer.checkpoint_callbacks if cb.monitor == str(cfg.ckpt.monitor))
    summary: dict[str, Any] = {
        "name": str(cfg.name),
        "model": model_config["name"],
        "parameters": count_parameters(module.model),
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "metrics": metrics,
        # None when no validation ran (check_val_every_n_epoch past the run, limit_val_batches=0): no best.ckpt
        "best": float(best_cb.best_model_score) if best_cb.best_model_score is not None else None,
        "monitor": str(cfg.ckpt.monitor),
        "time_s": time.perf_counter() - start,
        "output_dir": str(output_dir),
        "checkpoints": str(output_dir / "checkpoints"),
        "best_ckpt": best_cb.best_model_path or None,
        "last_ckpt": str(output_dir / "checkpoints" / "last.ckpt"),
        "logs": str(output_dir / "logs"),
        "tensorboard": str(output_dir / "tb"),
        "export": None,
        "world_size": int(trainer.world_size),
        "global_rank": int(trainer.global_rank),
    }
    if trainer.is_global_zero and cfg.export.safetensors:
        extra = {"metrics": metrics, "data": OmegaConf.to_container(cfg.data, resolve=True), "run": summary["name"]}
        path = write_export(module.model, output_dir / "export" / "model.safetensors", extra=extra,
                            overwrite=True)  # the run's own export
        if module.ema is not None:
            ema_model = module.ema.module
            if not hasattr(ema_model, "config"):
                ema_model.config = module.model.config
            write_export(ema_model, output_dir / "export" / "model_ema.safetensors",
                         extra={**extra, "weights": "ema"}, overwrite=True)
        summary["export"] = str(path)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    m = s["metrics"]

    def pct(key: str) -> str:
        return f"{m[key]:.2f}%" if key in m else "n/a"

    def loss(key: str) -> str:
        return f"{m[key]:.4f}" if key in m else "n/a"

    best = f"{s['best']:.2f}%" if s["best"] is not None else "n/a: no validation ran"
    kept = [n for n in ("last.ckpt", "best.ckpt") if (Path(s["checkpoints"]) / n).is_file()]

    lines = [
        "",
        f"== run {s['name']} ({s['model']}, {s['parameters'] / 1e6:.3f}M parameters) ==",
        f"epochs {s['epochs']}, steps {s['steps']}, time {s['time_s']:.1f} s",
    ]
    if "val/miou" in m:  # a segmentation run
        lines += [
            f"val   mIoU {pct('val/miou')}  pixel accuracy {pct('val/pixel_acc')}  "
            f"loss {loss('val/loss')}  (best {s.get('monitor', 'val/miou')} {best})",
            f"train mIoU {pct('train/miou')}  loss {loss('train/loss_epoch')}",
        ]
    else:
        lines += [
            f"val   top-1 {pct('val/top1')}  top-3 {pct('val/top3')}  top-5 {pct('val/top5')}  "
            f"loss {loss('val/loss')}  (best top-1 {best})",
            f"train top-1 {pct('train/top1_epoch') if 'train/top1_epoch' in m else pct('train/top1')}  "
            f"loss {loss('train/loss_epoch')}",
        ]
    if "val_ema/top1" in m:
        lines.append(f"EMA   top-1 {pct('val_ema/top1')}")
    lines += [
        f"checkpoints  {s['checkpoints']}  ({', '.join(kept) or 'none'})",
    ]
    logs = [f"{s[k]} ({kind})" for k, kind in (("logs", "CSV"), ("tensorboard", "TensorBoard")) if Path(s[k]).is_dir()]
    if logs:  # the `logger` group chooses them
        lines.append(f"logs         {', '.join(logs)}")
    if s.get("export"):
        lines.append(f"export       {s['export']} (+ .json config)")
    return os.linesep.join(lines)
