"""One conversion run from a composed config (``conf/convert.yaml``): teacher, student, field fit, distillation, export.

Layout of ``<output_dir>`` (that of a training run, docs/training.md, plus ``fit/``):

    config.yaml                 the composed, resolved config
    fit/report.md, report.json  how well each teacher head's attention is explained by the fitted Gaussians
    fit/fields.png              teacher attention beside the fitted field, best- and worst-explained heads
    checkpoints/, logs/, tb/    as for `ssogvit train` (resume from checkpoints/last.ckpt)
    export/model.safetensors    the converted model (config in model.json; reload with `load_converted`)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ssogvit.results import write_json

from .distill import RECIPES, ConversionModule
from .fit import fit_fields, format_report, plot_fit
from .student import build_student, load_teacher, teacher_grid

__all__ = ["IMAGE_SUFFIXES", "calibration_images", "convert", "output_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def output_folder(cfg: DictConfig) -> tuple[Path, str | None]:
    """The run's output folder, created, and the checkpoint to resume from (``resume: auto`` finds ``last.ckpt``).

    A folder that already holds files but no checkpoint to resume is refused: nothing written is overwritten.
    """
    from ssogvit.train.run import resolve_resume

    out = Path(str(cfg.output_dir)).expanduser()
    resume = resolve_resume(cfg, out / "checkpoints")
    if resume is None and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"output folder {out} already holds files and no checkpoint to resume from; choose another "
                         "output_dir (--out) or remove it")
    out.mkdir(parents=True, exist_ok=True)
    return out, resume


def calibration_images(folder: str | Path | None, dm: Any, count: int) -> torch.Tensor:
    """``count`` images ``(B, C, H, W)`` for the field fit: from ``folder`` (any depth, files with an image suffix,
    sorted) through the datamodule's evaluation transform, or else the first training batches."""
    if folder is None:
        batches, n = [], 0
        for x, _ in dm.train_dataloader():
            batches.append(x)
            n += len(x)
            if n >= count:
                break
        return torch.cat(batches)[:count]
    from PIL import Image

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"calibration folder {folder} does not exist or is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:count]
    if not files:
        raise ValueError(f"calibration folder {folder} holds no images (files ending in {', '.join(IMAGE_SUFFIXES)})")
    transform, mode = dm.eval_transform(), "L" if dm.in_chans == 1 else "RGB"
    return torch.stack([transform(Image.open(p).convert(mode)) for p in files])


def _check_data(teacher: torch.nn.Module, dm: Any) -> None:
    grid = teacher_grid(teacher)
    patch = tuple(int(p) for p in teacher.patch_embed.patch_size)
    data_grid = (dm.img_size // patch[0], dm.img_size // patch[1])
    if data_grid != grid or dm.img_size % patch[0] or dm.img_size % patch[1]:
        raise ValueError(f"the teacher's grid is {grid[0]}x{grid[1]} (patch {patch[0]}); images of {dm.img_size} px "
                         f"give {dm.img_size / patch[0]:g}x{dm.img_size / patch[1]:g}: set data.img_size="
                         f"{grid[0] * patch[0]} (conversion keeps the teacher's grid)")
    classes = int(getattr(teacher, "num_classes", 0))
    if classes != int(dm.num_classes):
        raise ValueError(f"the teacher has {classes} classes, the data {dm.num_classes}: conversion keeps the head")
    chans = int(teacher.patch_embed.proj.in_channels)
    if chans != int(dm.in_chans):
        raise ValueError(f"the teacher takes {chans} image channels, the data has {dm.in_chans}")


def convert(cfg: DictConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Run (or resume) the conversion described by ``cfg``; returns its summary (metrics, fit, paths)."""
    import lightning.pytorch as pl

    from ssogvit.train.io import export_safetensors
    from ssogvit.train.run import build_datamodule, build_trainer

    start = time.perf_counter()
    c = OmegaConf.to_container(cfg.convert, resolve=True)
    if not c.get("teacher"):
        raise ValueError("no teacher: pass --teacher PATH (convert.teacher)")
    if c["recipe"] not in RECIPES:
        raise ValueError(f"unknown conversion recipe {c['recipe']!r}; expected one of {RECIPES}")
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    teacher = load_teacher(c["teacher"], timm_model=c["timm_model"], timm_kwargs=c["timm_kwargs"],
                           use_ema=bool(c["use_ema"]))
    student = build_student(teacher, mixer=c["mixer"], **c["mixer_options"])  # checks the teacher first
    dm = build_datamodule(cfg)
    dm.prepare_data()
    _check_data(teacher, dm)
    out, resume = output_folder(cfg)

    fit_summary = None
    if resume is None:  # a resumed run takes its fields from the checkpoint
        images = calibration_images(c["calib"], dm, int(c["calib_images"]))
        fit = fit_fields(teacher, student, images, steps=int(c["fit_steps"]), lr=float(c["fit_lr"]))
        (out / "fit").mkdir(exist_ok=True)
        (out / "fit" / "report.md").write_text(format_report(fit))
        write_json(out / "fit" / "report.json", {"grid": fit.grid, "heads": fit.rows})
        plot_fit(fit, out / "fit" / "fields.png")
        fit_summary = {k: sum(r[k] for r in fit.rows) / len(fit.rows) for k in ("kl", "kl_uniform", "explained")}

    model_config = dict(getattr(student, "config", None) or student.config_timm)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {"optim": recipe["optim"], "sched": recipe["sched"], "batch_size": int(cfg.data.batch_size),
              "smoothing": float(cfg.loss.smoothing)}
    distill = {k: c[k] for k in ("recipe", "temperature", "kd_weight", "feature_weight", "steps_per_block",
                                 "field_lr_scale")}
    module = ConversionModule(student, teacher, recipe=recipe, distill=distill,
                              hparams={"model_config": model_config, "convert": c})
    trainer = build_trainer(cfg, out)
    if trainer.is_global_zero:
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
        if verbose and resume:
            print(f"resuming from {resume} (fields, weights and optimizer state from the checkpoint)")
    trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    summary: dict[str, Any] = {"name": str(cfg.name), "model": model_config.get("name", model_config.get("timm_model")),
                               "recipe": c["recipe"], "steps": int(trainer.global_step), "metrics": metrics,
                               "fit": fit_summary, "time_s": time.perf_counter() - start, "output_dir": str(out),
                               "export": None}
    if trainer.is_global_zero and cfg.export.safetensors:
        if not hasattr(student, "config"):
            student.config = model_config  # a timm student: its rebuild recipe (load_converted reads it)
        extra = {"metrics": metrics, "data": OmegaConf.to_container(cfg.data, resolve=True), "convert": c}
        summary["export"] = str(export_safetensors(student, out / "export" / "model.safetensors", extra=extra))
    if verbose and trainer.is_global_zero:
        top1 = metrics.get("val/top1")
        print(f"\n== conversion {summary['name']} ({summary['model']}, recipe {c['recipe']}) ==\n"
              f"steps {summary['steps']}, time {summary['time_s']:.1f} s, val top-1 "
              f"{'n/a' if top1 is None else f'{top1:.2f}%'}\n"
              f"fit report   {out / 'fit'}\ncheckpoints  {out / 'checkpoints'}\nexport       {summary['export']}")
    return summary
