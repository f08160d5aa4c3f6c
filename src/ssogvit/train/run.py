"""One training run from a composed config: data, model, Lightning trainer, checkpoints, export, summary.

Layout of `<output_dir>` (default `runs/<name>`):

    config.yaml                 the composed, resolved config of the run
    checkpoints/last.ckpt       refreshed every `ckpt.every_n_train_steps` steps and at each epoch end (resume)
    checkpoints/best.ckpt       best `ckpt.monitor` so far
    checkpoints/step=*.ckpt     the `ckpt.keep` most recent periodic checkpoints
    logs/version_*/metrics.csv  CSV log (one version per launch, resumed launches included)
    tb/version_*/               TensorBoard log
    export/model.safetensors    final weights, config beside it in model.json (+ model_ema.* with EMA)
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .config import model_config_from
from .io import CheckpointError, atomic_checkpoint_io, check_checkpoint, export_safetensors, read_model_config
from .module import ClassificationModule, count_parameters

__all__ = ["train", "build_trainer", "build_datamodule", "resolve_precision", "resolve_resume", "format_summary"]


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`auto` becomes `16-mixed` on CUDA and `32-true` elsewhere (mixed precision is a GPU-only setting here)."""
    if str(precision) != "auto":
        return str(precision)
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return "16-mixed" if on_gpu else "32-true"


def build_datamodule(cfg: DictConfig):
    from ssogvit.data import create_datamodule

    options = OmegaConf.to_container(cfg.data, resolve=True)
    return create_datamodule(options.pop("name"), **options)


def resolve_resume(cfg: DictConfig, ckpt_dir: Path) -> str | None:
    """The checkpoint to resume from (`resume: auto` -> `last.ckpt` if present), checked to be readable."""
    resume = cfg.get("resume")
    if resume in (None, False, "null", "none", "false"):
        return None
    path = ckpt_dir / "last.ckpt" if resume == "auto" else Path(str(resume))
    if resume == "auto" and not path.exists():
        return None
    check_checkpoint(path)  # a clear CheckpointError naming the intact ones, instead of a zip error mid-restore
    return str(path)


def build_trainer(cfg: DictConfig, output_dir: Path, *, callbacks: list | None = None, loggers: bool = True):
    """The Lightning `Trainer` for a run config, with checkpointing into `output_dir/checkpoints`."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    ckpt_dir = output_dir / "checkpoints"
    every = cfg.ckpt.every_n_train_steps
    cbs = [
        # best.ckpt (by ckpt.monitor) and last.ckpt at every validation; each file is written to a temporary file in
        # the same folder and renamed over the old one (atomic_checkpoint_io), so a kill never leaves a torn file.
        ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=str(cfg.ckpt.monitor), mode="max", save_top_k=1,
                        save_last=True, auto_insert_metric_name=False, enable_version_counter=False),
    ]
    if every:  # mid-epoch checkpoints: the ckpt.keep most recent, and last.ckpt refreshed with them
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step={step:07d}", auto_insert_metric_name=False,
                                   monitor="step", mode="max", save_top_k=int(cfg.ckpt.keep), save_last=True,
                                   every_n_train_steps=int(every), enable_version_counter=False))
    logger: Any = False
    if loggers:
        logger = [CSVLogger(str(output_dir), name="logs"), TensorBoardLogger(str(output_dir), name="tb",
                                                                            default_hp_metric=False)]
        cbs.append(LearningRateMonitor(logging_interval="step"))
    cbs += list(callbacks or [])
    accelerator = str(t.pop("accelerator"))
    precision = resolve_precision(t.pop("precision"), accelerator)
    limits = {k: t.pop(k) for k in ("limit_train_batches", "limit_val_batches") if t.get(k) is not None}
    t = {k: v for k, v in t.items() if k not in ("limit_train_batches", "limit_val_batches")}
    return pl.Trainer(accelerator=accelerator, precision=precision, callbacks=cbs, logger=logger,
                      default_root_dir=str(output_dir), plugins=[atomic_checkpoint_io()], **limits, **t)


def _run_model_config(cfg: DictConfig, dm) -> dict[str, Any]:
    src = cfg.transfer.ckpt
    if not src:
        return model_config_from(cfg)
    config = read_model_config(src)  # the source architecture, with a new head for the target classes
    config["num_classes"] = int(dm.num_classes)
    if int(config.get("in_chans", 3)) != int(dm.in_chans):
        raise ValueError(f"source model takes {config.get('in_chans', 3)} channels, the target data has {dm.in_chans}")
    return config


def train(cfg: DictConfig, *, callbacks: list | None = None, verbose: bool = True) -> dict[str, Any]:
    """Train (or resume) the run described by `cfg`; returns its summary (metrics, parameters, time, paths).

    Seeds with `seed_everything(cfg.seed, workers=True)`; with `trainer.deterministic` (default true) two runs with
    the same seed on CPU give identical metrics.
    """
    import lightning.pytorch as pl

    start = time.perf_counter()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    output_dir = Path(str(cfg.output_dir)).expanduser()
    output_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)

    dm = build_datamodule(cfg)
    dm.prepare_data()  # a missing dataset fails here, with its help text, before any model is built
    if int(dm.num_classes) <= 0:
        raise ValueError("the dataset has no classes: set data.num_classes or data.root")
    model_config = _run_model_config(cfg, dm)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {k: recipe[k] for k in ("optim", "sched", "loss", "mixup", "ema")}
    recipe["batch_size"] = int(cfg.data.batch_size)
    transfer = OmegaConf.to_container(cfg.transfer, resolve=True) if cfg.transfer.ckpt else None
    module = ClassificationModule(model_config, recipe, transfer)

    trainer = build_trainer(cfg, output_dir, callbacks=callbacks)
    resume = resolve_resume(cfg, output_dir / "checkpoints")
    if trainer.is_global_zero:
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
        if verbose and resume:
            print(f"resuming from {resume}")
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    best_cb = next(cb for cb in trainer.checkpoint_callbacks if cb.monitor == str(cfg.ckpt.monitor))
    summary: dict[str, Any] = {
        "name": str(cfg.name),
        "model": model_config["name"],
        "parameters": count_parameters(module.model),
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "metrics": metrics,
        "best": float(best_cb.best_model_score) if best_cb.best_model_score is not None else math.nan,
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
        path = export_safetensors(module.model, output_dir / "export" / "model.safetensors", extra=extra)
        if module.ema is not None:
            ema_model = module.ema.module
            if not hasattr(ema_model, "config"):
                ema_model.config = module.model.config
            export_safetensors(ema_model, output_dir / "export" / "model_ema.safetensors", extra=extra)
        summary["export"] = str(path)
    if verbose and trainer.is_global_zero:
        print(format_summary(summary))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    m = s["metrics"]

    def pct(key: str) -> str:
        return f"{m[key]:.2f}%" if key in m else "n/a"

    lines = [
        "",
        f"== run {s['name']} ({s['model']}, {s['parameters'] / 1e6:.3f}M parameters) ==",
        f"epochs {s['epochs']}, steps {s['steps']}, time {s['time_s']:.1f} s",
        f"val   top-1 {pct('val/top1')}  top-3 {pct('val/top3')}  top-5 {pct('val/top5')}  "
        f"loss {m.get('val/loss', math.nan):.4f}  (best top-1 {s['best']:.2f}%)",
        f"train top-1 {pct('train/top1_epoch') if 'train/top1_epoch' in m else pct('train/top1')}  "
        f"loss {m.get('train/loss_epoch', math.nan):.4f}",
    ]
    if "val_ema/top1" in m:
        lines.append(f"EMA   top-1 {pct('val_ema/top1')}")
    lines += [
        f"checkpoints  {s['checkpoints']}  (last.ckpt, best.ckpt)",
        f"logs         {s['logs']} (CSV), {s['tensorboard']} (TensorBoard)",
    ]
    if s.get("export"):
        lines.append(f"export       {s['export']} (+ .json config)")
    return os.linesep.join(lines)
