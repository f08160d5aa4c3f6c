"""One conversion run from a composed config (``conf/convert.yaml``): teacher, student, field fit, distillation, export.

Layout of ``<output_dir>`` (that of a training run, docs/training.md, plus ``fit/``), a folder that belongs to one
conversion (``ssogvit.train.run_folder.RunFolder``: locked while it runs, ``run.json`` says ``convert`` and its status, a
relaunch resumes the unfinished conversion of the same config and refuses anything else):

    config.yaml                 the composed, resolved config
    run.json                    "running" or "finished", command "convert"
    fit/report.md, report.json  how well each teacher head's attention is explained by the fitted Gaussians
    fit/fields.png              teacher attention beside the fitted field, best- and worst-explained heads
    checkpoints/, logs/, tb/    as for `ssogvit train` (resume from checkpoints/last.ckpt)
    export/model.safetensors    the converted model (config in model.json; reload with `load_converted`)

A conversion killed before its first epoch ended (during the field fit, say) fits again when relaunched; one killed
later resumes from ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ssogvit.documents import input_folder
from ssogvit.specs import AppliesOnly, Choice, Flag, Float, Int, check_applies
from ssogvit.outputs import atomic_write, check_output_folder, write_json, write_text
from ssogvit.train.run_folder import RunFolder

from .distill import RECIPES, ConversionModule
from .fit import fit_fields, format_report, plot_fit
from .student import build_student, load_teacher, teacher_grid

__all__ = ["CONVERT_RULES", "IMAGE_SUFFIXES", "calibration_images", "convert", "output_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def output_folder(cfg: DictConfig) -> RunFolder:
    """The run's output folder (``output_dir``) as the conversion's ``RunFolder`` (nothing is written yet)."""
    return RunFolder(Path(str(cfg.output_dir)).expanduser(), command="convert", elsewhere="--out <new folder>")


#: the conversion's own settings (``convert:`` in conf/convert.yaml), checked with the run config's before any work
CONVERT_RULES = {
    "convert.use_ema": Flag(), "convert.mixer": Choice(("ssog", "ssog-steered")), "convert.calib_images": Int(1, 100_000),
    "convert.fit_steps": Int(0, 1_000_000), "convert.fit_lr": Float(0, low_open=True),
    "convert.recipe": Choice(tuple(RECIPES)), "convert.temperature": Float(0, low_open=True),
    "convert.kd_weight": Float(0), "convert.feature_weight": Float(0), "convert.field_lr_scale": Float(0, low_open=True),
    "convert.steps_per_block": Int(1, 1_000_000),
}
#: the conversion's options that the others can leave unused (``specs.check_applies``): refused where they would be
#: recorded and ignored
CONVERT_APPLIES = {
    "convert.feature_weight": AppliesOnly(lambda c: c["recipe"] != "logits",
                                          "convert.recipe=blocks or progressive (the hidden-state matching)"),
    "convert.steps_per_block": AppliesOnly(lambda c: c["recipe"] == "progressive", "convert.recipe=progressive"),
    "convert.fit_lr": AppliesOnly(lambda c: c["fit_steps"] > 0, "convert.fit_steps > 0 (a field fit)"),
}


def _convert_defaults() -> dict[str, Any]:
    """The ``convert:`` section as conf/convert.yaml declares it (what an option left alone is)."""
    from ssogvit.train.config import compose

    return OmegaConf.to_container(compose(config_name="convert", allow_unset=True).convert, resolve=False)


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

    folder = input_folder(folder, "--calib")
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
    """Run (or resume) the conversion described by ``cfg``; returns its summary (metrics, fit, paths).

    Everything is checked before the folder is touched (the config's values, the teacher, the data); then the folder
    is claimed (``RunFolder``): a fresh one, or the unfinished conversion of this config, resumed.
    """
    import lightning.pytorch as pl

    from ssogvit.train.config import check_run_config
    from ssogvit.train.io import write_export
    from ssogvit.train.run import build_datamodule, build_trainer, fit

    start = time.perf_counter()
    check_run_config(cfg)
    c = OmegaConf.to_container(cfg.convert, resolve=True)
    if not c.get("teacher"):
        raise ValueError("no teacher: pass --teacher PATH (convert.teacher)")
    for key, spec in CONVERT_RULES.items():
        spec.check(c[key.split(".", 1)[1]], key)
    defaults = _convert_defaults()
    check_applies(CONVERT_APPLIES, {k: c[k.split(".", 1)[1]] for k in CONVERT_APPLIES},
                  {k: defaults[k.split(".", 1)[1]] for k in CONVERT_APPLIES}, c)
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    teacher = load_teacher(c["teacher"], timm_model=c["timm_model"], timm_kwargs=c["timm_kwargs"],
                           use_ema=bool(c["use_ema"]))
    student = build_student(teacher, mixer=c["mixer"], **c["mixer_options"])  # checks the teacher first
    dm = build_datamodule(cfg)
    dm.prepare_data()
    _check_data(teacher, dm)
    if c["calib"] is not None:
        input_folder(c["calib"], "--calib")
    folder = output_folder(cfg)
    check_output_folder(folder.path, "--out", run=True)
    with folder.claim(cfg.get("resume"), OmegaConf.to_container(cfg, resolve=True)) as resume:
        folder.begin(lambda tmp: OmegaConf.save(cfg, tmp, resolve=True), resumed_from=resume)
        summary = _convert(cfg, c, folder.path, teacher, student, dm, resume, start, verbose,
                           build_trainer=build_trainer, fit=fit, export=write_export)
        folder.write_state("finished", steps=summary["steps"], export=summary["export"])
    return summary


def _convert(cfg: DictConfig, c: dict[str, Any], out: Path, teacher, student, dm, resume: str | None, start: float,
             verbose: bool, *, build_trainer, fit, export) -> dict[str, Any]:
    fit_summary = None
    if resume is None:  # a resumed run takes its fields from the checkpoint
        images = calibration_images(c["calib"], dm, int(c["calib_images"]))
        result = fit_fields(teacher, student, images, steps=int(c["fit_steps"]), lr=float(c["fit_lr"]))
        write_text(out / "fit" / "report.md", format_report(result), overwrite=True)  # this run's own files
        write_json(out / "fit" / "report.json", {"grid": result.grid, "steps": result.steps, "lr": result.lr,
                                                  "heads": result.rows}, overwrite=True, default=str)
        atomic_write(out / "fit" / "fields.png", lambda tmp: plot_fit(result, tmp), overwrite=True)
        fit_summary = {k: sum(r[k] for r in result.rows) / len(result.rows) for k in ("kl", "kl_uniform", "explained")}

    model_config = dict(getattr(student, "config", None) or student.config_timm)
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe = {"optim": recipe["optim"], "sched": recipe["sched"], "batch_size": int(cfg.data.batch_size),
              "smoothing": float(cfg.loss.smoothing)}
    distill = {k: c[k] for k in ("recipe", "temperature", "kd_weight", "feature_weight", "steps_per_block",
                                 "field_lr_scale")}
    module = ConversionModule(student, teacher, recipe=recipe, distill=distill,
                              hparams={"model_config": model_config, "convert": c})
    trainer = build_trainer(cfg, out)
    if verbose and resume and trainer.is_global_zero:
        print(f"resuming from {resume} (fields, weights and optimizer state from the checkpoint)")
    fit(trainer, module, dm, resume, out)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    summary: dict[str, Any] = {"name": str(cfg.name), "model": model_config.get("name", model_config.get("timm_model")),
                               "recipe": c["recipe"], "steps": int(trainer.global_step), "metrics": metrics,
                               "fit": fit_summary, "time_s": time.perf_counter() - start, "output_dir": str(out),
                               "export": None}
    if trainer.is_global_zero and cfg.export.safetensors:
        if not hasattr(student, "config"):
            student.config = model_config  # a timm student: its rebuild recipe (load_converted reads it)
        extra = {"metrics": metrics, "data": OmegaConf.to_container(cfg.data, resolve=True), "convert": c}
        summary["export"] = str(export(student, out / "export" / "model.safetensors", extra=extra, overwrite=True))
    if verbose and trainer.is_global_zero:
        top1 = metrics.get("val/top1")
        print(f"\n== conversion {summary['name']} ({summary['model']}, recipe {c['recipe']}) ==\n"
              f"steps {summary['steps']}, time {summary['time_s']:.1f} s, val top-1 "
              f"{'n/a' if top1 is None else f'{top1:.2f}%'}\n"
              f"fit report   {out / 'fit'}\ncheckpoints  {out / 'checkpoints'}\nexport       {summary['export']}")
    return summary
