"""`ssogvit analyze <what> ...`: every analysis as a command writing a PNG and/or JSON + markdown, with a summary.

    ssogvit analyze fields    --ckpt runs/a/export/model.safetensors --ckpt runs/b/export/model.safetensors
    ssogvit analyze sinks     --model vit-tiny-ssog --model vit-tiny-mha   # fresh random models
    ssogvit analyze all       --ckpt ... --out runs/analysis
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssogvit.errors import ArgumentParser, UsageError, report_errors
from ssogvit.errors import InputError
from ssogvit.resources import check_memory
from ssogvit.specs import IMG_SIZE, PATCH_SIZE, SEED, Float, Int, Ints, Spec
from ssogvit.layers import is_ssog
from ssogvit.outputs import (
    OVERWRITE_FLAG,
    OutputExistsError,
    check_output_folder,
    check_replaceable,
    staged_outputs,
    write_json,
)
from ssogvit.results import fmt, jsonable, markdown_table, write_markdown
from ssogvit.train.config import split_override

from . import _data
from .atoms import atoms_report, plot_atoms
from .fields import plot_fields, plot_query_fields
from .lipschitz import lipschitz_report, plot_lipschitz
from .sinks import plot_sinks, sink_report
from .steering import plot_steering, steering_stats
from .transfer import plot_transfer, transfer_table

ANALYSES = ("fields", "atoms", "lipschitz", "sinks", "steering", "transfer")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="ssogvit analyze",
        description="Look inside trained (--ckpt) or freshly built (--model) models. Writes <out>/<what>.png, "
        ".json and .md and prints a summary.",
    )
    p.add_argument("what", choices=(*ANALYSES, "all"))
    p.add_argument("--ckpt", action="append", default=[], help="checkpoint (.ckpt) or export (.safetensors); repeat")
    p.add_argument("--model", action="append", default=[], help="model name for a fresh random model; repeat")
    p.add_argument("--model-kw", action="append", default=[], metavar="KEY=VALUE",
                   help="option for every --model (YAML value), e.g. depth=4; default: the dataset's classes, "
                   "channels and image size, and patch_size = img_size // 8 below 128 px")
    p.add_argument("--label", action="append", default=[], help="names for the models, in order (--ckpt first)")
    p.add_argument("--data", default=None, help="dataset of the evaluation images when the checkpoint records none "
                   "(default digits)")
    p.add_argument("--num-images", type=Int(1, 100_000).argparse, default=64,
                   help="validation images for sinks and steering")
    p.add_argument("--transfer-images", type=Int(1, 100_000).argparse, default=None,
                   help="validation images for transfer (all)")
    p.add_argument("--image-index", type=Int(0).argparse, default=0, help="validation image whose query field is drawn")
    p.add_argument("--query", type=Ints(Int(0), min_len=2).argparse, default=None,
                   help="query cell 'y,x' of the field drawing (grid centre by default)")
    p.add_argument("--radii", type=RADII.argparse, default=None,
                   help="ball radii for steered mixers, in units of sqrt(D): '0.5,1,2,4'")
    p.add_argument("--iters", type=Int(1, 10_000).argparse, default=30,
                   help="power-iteration steps (at most 15 for steered mixers)")
    p.add_argument("--samples", type=Int(1, 1000).argparse, default=2, help="inputs per radius for steered mixers")
    p.add_argument("--max-steered", type=Int(1, 1000).argparse, default=3,
                   help="steered mixers measured (first, middle, last)")
    p.add_argument("--patch-sizes", type=Ints(PATCH_SIZE).argparse, default=None,
                   help="patch sizes for transfer, e.g. '16,14,8'")
    p.add_argument("--img-sizes", type=Ints(IMG_SIZE).argparse, default=None,
                   help="image sizes for transfer (default: 0.75x and 1.5x)")
    p.add_argument("--out", default="runs/analysis", help="output folder")
    p.add_argument(OVERWRITE_FLAG, action="store_true", help="replace files already in --out")
    p.add_argument("--seed", type=SEED.argparse, default=0)
    return p


class _Radii(Spec):
    """Comma-separated positive radii (`0.5,1,2,4`), as a list of floats."""

    def expected(self) -> str:
        return "a comma-separated list of positive numbers, e.g. 0.5,1,2,4"

    def _check(self, value, name):
        radius = Float(0, low_open=True)
        if not isinstance(value, list) or not value:
            raise InputError(f"{name}={value!r}: expected {self.expected()}", argument=name, expected=self.expected())
        try:
            return [radius.check(v, name) for v in value]
        except InputError:
            raise InputError(f"{name}={value!r}: expected {self.expected()}", argument=name,
                             expected=self.expected()) from None

    def _parse(self, text, name):
        return [Float()._parse(v.strip(), name) for v in text.split(",") if v.strip()]


RADII = _Radii()


def load_models(args: argparse.Namespace) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The models to analyse, by label, and the data config of their evaluation images."""
    import yaml

    if not args.ckpt and not args.model:
        raise UsageError("give at least one --ckpt PATH or --model NAME (e.g. vit-tiny-ssog)")
    cfg = _data.data_config(args.data, args.ckpt[0] if args.ckpt else None)
    models: list[tuple[str, nn.Module]] = []
    if args.ckpt:
        from ssogvit.train.io import load_model

        for path in args.ckpt:
            model = load_model(path)
            parts = Path(path).resolve().parts
            run = parts[-3] if len(parts) >= 3 and parts[-2] in ("export", "checkpoints") else Path(path).stem
            if getattr(model, "backbone", None) is not None:  # a segmentation model (docs/dense.md): its encoder
                model = model.backbone.eval()
                model.segmentation = True
            models.append((run, model))
    if args.model:
        from ssogvit.models import create_model

        img = int(cfg["img_size"])
        first = dict(getattr(models[0][1], "config", {})) if models else {}  # imagefolder's config: null classes
        kwargs: dict[str, Any] = {"num_classes": int(cfg.get("num_classes") or first.get("num_classes") or 10),
                                  "in_chans": int(cfg.get("in_chans") or first.get("in_chans") or 3),
                                  "img_size": img}
        if img < 128:
            kwargs["patch_size"] = max(1, img // 8)
        given: dict[str, str] = {}
        for item in args.model_kw:
            key, value = split_override(item)
            if value is None:
                raise UsageError(f"--model-kw {item!r} is not KEY=VALUE (e.g. --model-kw depth=2)")
            if key.strip() in given:
                raise UsageError(f"--model-kw {key.strip()} is given twice ({given[key.strip()]}, then {item}); "
                                 "give it once")
            given[key.strip()] = item
            kwargs[key.strip()] = yaml.safe_load(value)
        for name in args.model:
            torch.manual_seed(args.seed)
            try:
                models.append((name, create_model(name, **kwargs).eval()))
            except (ValueError, TypeError) as err:  # an unknown name or option, a value out of range
                raise UsageError(f"--model {name}: {str(err).splitlines()[0]}") from None
    if len(args.label) > len(models):  # a label for no model would be dropped
        raise UsageError(f"{len(args.label)} --label for {len(models)} model(s): give at most one per --ckpt/--model")
    labels = list(args.label) + [label for label, _ in models][len(args.label):]
    out: dict[str, nn.Module] = {}
    for label, (_, model) in zip(labels, models):
        while label in out:
            label += "'"
        out[label] = model
    return out, cfg


# -- one function per analysis ----------------------------------------------------------------------------------------


def run_atoms(models, cfg, args, out: Path) -> dict:
    reports = {label: atoms_report(m) for label, m in models.items()}
    rows = [(label, row["layer"], ", ".join(f"{v:.2f}" for v in row["per_head"]), row["mean"])
            for label, rep in reports.items() for row in rep["layers"]]
    rows += [(label, "**mean**", "", rep["mean"]) for label, rep in reports.items() if rep["layers"]]
    md = "## Effective atoms exp(entropy(λ))\n\n" + markdown_table(["model", "mixer", "per head", "mean"], rows)
    files = _write(out, "atoms", reports, md, plot_atoms(reports, out / "atoms.png"))
    for label, rep in reports.items():
        msg = f"mean {rep['mean']:.3f} of R={rep['num_atoms']}" if rep["layers"] else "no SSoG mixer"
        print(f"atoms  {label}: {msg}")
    return {"reports": reports, "files": files}


def run_lipschitz(models, cfg, args, out: Path) -> dict:
    reports = {}
    for label, m in models.items():
        radii = None
        if args.radii is not None:
            radii = [f * math.sqrt(m.embed_dim) for f in args.radii]
        reports[label] = lipschitz_report(m, radii=radii, iters=args.iters, seed=args.seed, samples=args.samples,
                                          max_steered=args.max_steered)
    fixed = [(label, r["layer"], r["bound"], r["estimate"], r["ratio"])
             for label, rep in reports.items() for r in rep["fixed"]]
    steered = [(label, row["layer"], g["radius"], g["local_max"], g["frozen_bound_max"])
               for label, rep in reports.items() for row in rep["steered"] for g in row["growth"]]
    md = "## Lipschitz constants\n\n"
    if fixed:
        md += "Fixed SSoG: Proposition-1 bound and power-iteration estimate (float64).\n\n"
        md += markdown_table(["model", "mixer", "bound", "estimate", "estimate / bound"], fixed) + "\n"
    if steered:
        steps = sorted({row["iters"] for rep in reports.values() for row in rep["steered"]})
        md += ("Steered SSoG: largest local constant ||J(x)||₂ found with every token of norm r, and the "
               f"Proposition-1 bound of the geometry frozen at those inputs ({', '.join(map(str, steps))} "
               "power-iteration steps).\n\n")
        if args.iters > max(steps):
            print(f"lipschitz: --iters {args.iters}: the steered mixers' estimates take {max(steps)} steps, the most "
                  "they take (docs/analysis.md)")
        md += markdown_table(["model", "mixer", "r", "local ||J||", "frozen bound"], steered)
    files = _write(out, "lipschitz", reports, md, plot_lipschitz(reports, out / "lipschitz.png"))
    for label, rep in reports.items():
        if rep["fixed"]:
            worst = max(r["ratio"] for r in rep["fixed"])
            print(f"lipschitz  {label}: {len(rep['fixed'])} fixed mixers, bound max "
                  f"{max(r['bound'] for r in rep['fixed']):.4g}, estimate/bound max {worst:.3f}"
                  f" ({'ok' if worst <= 1 + 1e-9 else 'ABOVE THE BOUND'})")
        for row in rep["steered"]:
            g = row["growth"]
            print(f"lipschitz  {label} {row['layer']}: local ||J|| {g[0]['local_max']:.4g} at r={g[0]['radius']:.3g}"
                  f" -> {g[-1]['local_max']:.4g} at r={g[-1]['radius']:.3g}")
        if not rep["fixed"] and not rep["steered"]:
            print(f"lipschitz  {label}: no SSoG mixer")
    return {"reports": reports, "files": files}


def run_sinks(models, cfg, args, out: Path) -> dict:
    images, _ = _data.validation_set(cfg, limit=args.num_images)
    summaries = {label: sink_report(m, images) for label, m in models.items()}
    head = ["model", "sink mean", "sink worst (layer)", "rollout", "same-key", "CLS mass", "high-norm", "images"]
    rows = [(label, s["sink_mean"], f"{fmt(s['sink_worst'])} ({s['sink_worst_layer']})", s["sink_rollout"],
             s["same_key"], s["cls_mass"], s["high_norm"], s["num_images"]) for label, s in summaries.items()]
    md = ("## Attention sinks (paper Table 5)\n\nSink score: most-attended key's received attention over the "
          "uniform share (1 = no sink), head-averaged maps.\n\n" + markdown_table(head, rows))
    files = _write(out, "sinks", summaries, md, plot_sinks(summaries, out / "sinks.png"))
    for label, s in summaries.items():
        print(f"sinks  {label}: mean {s['sink_mean']:.3f}, worst {s['sink_worst']:.3f} (application "
              f"{s['sink_worst_layer']}), rollout {s['sink_rollout']:.3f}, same-key {s['same_key']:.3f}, "
              f"CLS mass {s['cls_mass']:.4f}, high-norm {s['high_norm']:.4f} on {s['num_images']} images")
    return {"summaries": summaries, "files": files}


def run_steering(models, cfg, args, out: Path) -> dict:
    images, _ = _data.validation_set(cfg, limit=args.num_images)
    stats = {label: steering_stats(m, images) for label, m in models.items()}
    rows = [(label, r["layer"], r["gates"].get("mu"), r["gates"].get("sigma"), r["gates"].get("lambda"),
             r["mean_delta_mu"], r["max_delta_mu"], r["effective_radius"], r["mean_log_sigma_ratio"],
             r["mean_lambda_tv"]) for label, s in stats.items() for r in s["mixers"]]
    head = ["model", "mixer", "s_mu", "s_sigma", "s_lambda", "mean |Δμ| per axis", "max |Δμ| per axis",
            "eff. radius s_μ·M",
            "mean |log σ_t/σ|", "mean TV(λ_t, λ)"]
    md = "## Steering statistics\n\n" + (markdown_table(head, rows) if rows else "No steered mixer.\n")
    steered = {label: s for label, s in stats.items() if s["mixers"]}
    png = None
    for label, s in steered.items():
        name = "steering.png" if len(steered) == 1 else f"steering_{_slug(label)}.png"
        png = plot_steering(s, out / name, title=label) or png
    files = _write(out, "steering", stats, md, png)
    for label, s in stats.items():
        if not s["mixers"]:
            print(f"steering  {label}: no steered mixer")
            continue
        mean = sum(r["mean_delta_mu"] for r in s["mixers"]) / len(s["mixers"])
        gates = {k: max(r["gates"].get(k, 0.0) for r in s["mixers"]) for k in ("mu", "sigma", "lambda")}
        print(f"steering  {label}: mean |Δμ| per axis {mean:.4g} cells, largest gates " +
              ", ".join(f"s_{k} {v:.3g}" for k, v in gates.items()) +
              f", effective radius up to {max(r['effective_radius'] for r in s['mixers']):.3g} cells")
    return {"stats": stats, "files": files}


def run_transfer(models, cfg, args, out: Path) -> dict:
    dense = [label for label, m in models.items() if getattr(m, "segmentation", False)]
    if dense and args.what == "transfer":
        raise UsageError(f"transfer measures a classifier's top-1; {', '.join(dense)} segment(s): `ssogvit eval "
                         "--ckpt ... --img-size N` gives a segmentation model's mIoU at another size")
    for label in dense:
        print(f"transfer  {label}: skipped (a segmentation model: `ssogvit eval --img-size N` gives its mIoU at "
              "another size)")
    models = {label: m for label, m in models.items() if label not in dense}
    if not models:
        return {"tables": {}, "files": {}}

    def images_at(size: int):
        return _data.validation_set(cfg, img_size=size, limit=args.transfer_images)

    tables = {}
    for label, m in models.items():
        s0 = int(m.img_size[0])
        sizes = args.img_sizes
        if sizes is None:
            sizes = [int(round(0.75 * s0)), int(round(1.5 * s0))]
        patch = int(m.patch_size)
        bad = [size for size in (args.img_sizes or []) if size % patch]
        if bad:  # it would be evaluated at the nearest multiple, or dropped where that is the trained size
            raise UsageError(f"--img-sizes {bad[0]} is not a multiple of the patch size {patch} of {label}; give "
                             f"multiples of {patch}")
        for size in sizes:
            check_memory(m.forward_bytes(1, size) + 4 * m.in_chans * size**2 * (args.transfer_images or 1),
                         f"the transfer images of {size} px", "--img-sizes")
        tables[label] = transfer_table(m, images_at, patch_sizes=args.patch_sizes, img_sizes=sizes)
    rows = [(label, r["kind"], r["patch"], r["img_size"], f"{r['grid'][0]}x{r['grid'][1]}",
             "yes" if r["rescale"] else "no", f"{100 * r['top1']:.2f}") for label, t in tables.items() for r in t]
    md = ("## Transfer without retraining (paper Table 13)\n\n"  # percent, as every other accuracy printed
          + markdown_table(["model", "change", "patch", "image", "grid", "μ, σ rescaled", "top-1 (%)"], rows))
    files = _write(out, "transfer", tables, md, plot_transfer(tables, out / "transfer.png"))
    for label, t in tables.items():
        print(f"transfer  {label}: " + "; ".join(
            f"p{r['patch']}/{r['img_size']}px{' resc' if r['rescale'] else ''} {100 * r['top1']:.2f}%" for r in t))
    return {"tables": tables, "files": files}


def run_fields(models, cfg, args, out: Path) -> dict:
    images, labels = _data.validation_set(cfg, limit=args.image_index + 1)
    if args.image_index >= len(images):
        raise UsageError(f"--image-index {args.image_index}: the validation set has {len(images)} images")
    if args.query is not None and len(args.query) != 2:
        raise UsageError(f"--query {','.join(map(str, args.query))}: expected one cell 'y,x'")
    query = tuple(args.query) if args.query else None
    for m in models.values():  # checked before any drawing: each model's grid of patches on this image
        grid = (int(images.shape[-2]) // m.patch_size, int(images.shape[-1]) // m.patch_size)
        if query is not None and not (query[0] < grid[0] and query[1] < grid[1]):
            raise UsageError(f"--query {query[0]},{query[1]}: outside the {grid[0]}x{grid[1]} grid of patches; "
                             f"expected y in [0, {grid[0] - 1}] and x in [0, {grid[1] - 1}]")
    pngs = []
    ssog = {label: m for label, m in models.items() if any(is_ssog(x) for x in m.mixers())}
    for label, m in ssog.items():
        name = "fields_atoms.png" if len(ssog) == 1 else f"fields_atoms_{_slug(label)}.png"
        pngs.append(plot_fields(m, out / name, title=f"{label}: SSoG atoms, offsets from the query cell (grey) in grid "
                                "cells\ncentre +, 1σ filled (opacity by λ), 2σ dashed"))
    path, summary = plot_query_fields(models, images[args.image_index], out / "fields_query.png", query=query)
    pngs.append(path)
    rows = [(label, a, local, peak) for label, s in summary.items()
            for a, local, peak in zip(s["applications"], s["local_3x3"], s["peak"])]
    md = (f"## Attention field of query cell {next(iter(summary.values()))['query']} on validation image "
          f"{args.image_index} ({_label_text(labels[args.image_index])})\n\n"
          + markdown_table(["model", "application", "mass in 3x3 around query", "peak weight"], rows))
    files = _write(out, "fields", {"query": summary, "atom_pictures": [str(p) for p in pngs[:-1]]}, md, None)
    files["png"] = [str(p) for p in pngs]
    for label, s in summary.items():
        print(f"fields  {label}: query {tuple(s['query'])}, 3x3 mass " +
              ", ".join(f"{v:.2f}" for v in s["local_3x3"]) + f" (applications {s['applications']})")
    print(f"fields  drew {len(pngs)} picture(s)")
    return {"query": summary, "files": files}


RUNNERS = {"fields": run_fields, "atoms": run_atoms, "lipschitz": run_lipschitz, "sinks": run_sinks,
           "steering": run_steering, "transfer": run_transfer}


def _label_text(label: torch.Tensor) -> str:
    """An evaluation image's label as the fields table names it: its class, or the classes in its mask."""
    if label.ndim == 0:
        return f"label {int(label)}"
    return "mask classes " + ", ".join(str(int(c)) for c in label.unique())


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def _write(out: Path, what: str, data, md: str, png) -> dict:
    files = {"json": str(write_json(out / f"{what}.json", data, overwrite=True, default=jsonable)),
             "md": str(write_markdown(out / f"{what}.md", md))}
    if png is not None:
        files["png"] = str(png)
    return files


def analyze(what: str, argv: list[str] | None = None, **overrides) -> dict:
    """Run one analysis (or `"all"`) as the command would, returning what it wrote and computed."""
    args = build_parser().parse_args([what, *(argv or [])])
    for key, value in overrides.items():
        setattr(args, key, value)
    return _run(args)


def _published(files: Any, stage: Path, out: Path) -> Any:
    """`files` (paths under `stage`, in a dict / list / str) as the paths they have under `out` once published."""
    if isinstance(files, dict):
        return {k: _published(v, stage, out) for k, v in files.items()}
    if isinstance(files, list):
        return [_published(v, stage, out) for v in files]
    return str(files).replace(str(stage), str(out)) if isinstance(files, (str, Path)) else files


def _run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    todo = ANALYSES if args.what == "all" else (args.what,)
    out = check_output_folder(args.out, "--out")
    planned = [out / f"{w}.{ext}" for w in todo for ext in ("json", "md")]
    for path in planned:  # before any work: a link, a folder or a device there is never replaced, asked or not
        check_replaceable(path, "--out")
    existing = [str(path) for path in planned if path.exists()]
    if existing and not args.overwrite:  # before any work; the rest (pictures) is checked when they are written
        raise OutputExistsError(f"--out: {', '.join(existing[:3])} already exist(s); pass {OVERWRITE_FLAG} to "
                                "replace, or choose another folder", argument="--out")
    models, cfg = load_models(args)
    results = {}
    with staged_outputs(out, "--out", overwrite=args.overwrite) as stage:
        for what in todo:
            results[what] = RUNNERS[what](models, cfg, args, stage)
    for what in todo:
        results[what]["files"] = _published(results[what]["files"], stage, out)
        print(f"{what}: " + json.dumps(results[what]["files"]))
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ssogvit analyze`."""
    args = build_parser().parse_args(argv)
    return report_errors("ssogvit analyze", lambda: _run(args) and 0)
