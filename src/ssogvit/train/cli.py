"""`ssogvit train | eval | transfer | list`: the commands of the training pipeline."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import yaml

from ssogvit.errors import ArgumentParser, report_errors
from ssogvit.documents import read_document
from ssogvit.resources import check_device, check_memory
from ssogvit.specs import PATCH_SIZE, Int, add_img_size_option
from ssogvit.layers import is_ssog
from ssogvit.outputs import OVERWRITE_FLAG, check_output_file, write_json

from .config import split_override

__all__ = ["train_main", "eval_main", "transfer_main", "list_main", "evaluate", "run_config_command"]


def train_main(argv: list[str]) -> int:
    """`ssogvit train [-m] [--cfg job] [--help] overrides...`: Hydra's command line (`ssogvit.train.hydra_app`)."""
    return run_config_command("ssogvit train", argv, _train)


def run_config_command(prog: str, argv: list[str], task, *, overrides: list[str] | tuple[str, ...] = (),
                       config_name: str = "config") -> int:
    """A command that runs `task(cfg)` on a Hydra config: Hydra's command line, user errors in one or two lines.

    `config_name` is the primary config in `ssogvit/conf` (e.g. `convert`). `--print-config` is kept as the short
    form of `--cfg job --resolve`.
    """
    from .hydra_app import hydra_command

    argv = [a for flag in argv for a in (("--cfg", "job", "--resolve") if flag == "--print-config" else (flag,))]
    return report_errors(prog, lambda: hydra_command(prog, argv, task, overrides=overrides, config_name=config_name))


def _train(cfg, *, fresh_output: bool = False) -> int:
    from pathlib import Path

    from .components import check_components
    from .config import check_complete
    from .run import train
    from .run_folder import fresh_folder

    check_complete(cfg)  # a paper detail the text lacks must be given (IncompleteExperimentError)
    check_components(cfg)  # a logger's missing package is refused before anything is written
    if fresh_output:
        out = fresh_folder(Path(str(cfg.output_dir)).expanduser())
        if str(out) != str(Path(str(cfg.output_dir)).expanduser()):
            print(f"{cfg.output_dir} holds another run; writing to {out}")
        cfg.output_dir = str(out)
    train(cfg)
    return 0


#: command -> (description, help of --ckpt) of the commands that start from a checkpoint
_CHECKPOINT_COMMANDS: dict[str, tuple[str, str | None]] = {
    "transfer": (
        ("Linear probe or fine-tune a trained model on another dataset. Remaining arguments are Hydra's command line "
         "as for `ssogvit train`: overrides (e.g. data=cifar100 data.root=... trainer.max_epochs=10), -m sweeps, "
         "--cfg job."),
        "source .ckpt or .safetensors",
    ),
    "eval": (
        ("Evaluate a checkpoint (.ckpt or .safetensors) on its validation set, optionally at another image size or "
         "patch size. Remaining arguments are Hydra overrides for the data (default: the data config saved with the "
         "run, e.g. data.root=/elsewhere)."),
        None,
    ),
}


def _checkpoint_parser(command: str) -> ArgumentParser:
    """The parser of ``ssogvit <command>``, a command that starts from a checkpoint: ``--ckpt PATH``, required."""
    description, ckpt_help = _CHECKPOINT_COMMANDS[command]
    parser = ArgumentParser(prog=f"ssogvit {command}", description=description)
    parser.add_argument("--ckpt", required=True, help=ckpt_help)
    return parser


def _source_tag(ckpt: str) -> str:
    """A folder-name tag for a source checkpoint: its run folder and file stem (`digits_vit_ssog_best`)."""
    import re
    from pathlib import Path

    path = Path(ckpt)
    tag = f"{path.parent.parent.name}_{path.stem}" if path.parent.name in ("checkpoints", "export") else path.stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tag).strip("_.") or "source"


def transfer_main(argv: list[str]) -> int:
    """`ssogvit transfer --ckpt PATH [--mode linear|finetune] [--use-ema] overrides...`"""
    parser = _checkpoint_parser("transfer")
    parser.add_argument("--mode", choices=("linear", "finetune"), default="linear")
    parser.add_argument("--use-ema", action="store_true", help="take the EMA weights of the source checkpoint")
    args, overrides = parser.parse_known_args(argv)
    return report_errors("ssogvit transfer", lambda: _transfer(args, overrides))


#: the settings `ssogvit transfer` takes from its own options: an override of one of them would contradict the option
_TRANSFER_FLAGS = {"transfer.ckpt": "--ckpt", "transfer.mode": "--mode", "transfer.use_ema": "--use-ema"}


def _refuse_flag_overrides(command: str, flags: dict[str, str], overrides: list[str]) -> None:
    """A `ConfigError` for an override of a setting the command takes from one of its options (`flags`: dotted key ->
    the option): both would be recorded, one obeyed."""
    from .errors import ConfigError

    for key, override in ((split_override(o)[0], o) for o in overrides):
        if key in flags:
            raise ConfigError(f"{override!r} contradicts {flags[key]}: {command} takes {key} from its option "
                              f"{flags[key]}; give it there, once")


def _transfer(args: argparse.Namespace, overrides: list[str]) -> int:
    _refuse_flag_overrides("transfer", _TRANSFER_FLAGS, overrides)
    base = [f"transfer.ckpt={args.ckpt}", f"transfer.mode={args.mode}", f"transfer.use_ema={args.use_ema}"]
    if not any(o.startswith("name=") for o in overrides):  # two sources never share a run folder
        base.append(f"name=transfer_{args.mode}_${{data.name}}_{_source_tag(args.ckpt)}")
    if args.mode == "linear" and not any(o.startswith("mixup.") for o in overrides):
        base += ["mixup.mixup_alpha=0.0", "mixup.cutmix_alpha=0.0"]
    # Without an explicit output_dir a transfer picks a fresh folder (runs/<name>, runs/<name>-2, ...); with one, the
    # folder rules of `ssogvit train` apply (resume its unfinished run, refuse a finished or different one).
    fresh = not any(split_override(o)[0] == "output_dir" for o in overrides)
    return run_config_command("ssogvit transfer", overrides, functools.partial(_train, fresh_output=fresh),
                              overrides=base)


def evaluate(model: Any, dm: Any, *, device: str = "cpu", progress: str = "auto") -> dict[str, float]:
    """Top-1/3/5 accuracy (%) and mean cross-entropy of `model` on `dm`'s validation set.

    `progress`: `bar` (tqdm), `lines` (about ten plain lines, no `\\r` frames), `none`, or `auto` (the bar on a
    terminal, lines otherwise; `ssogvit.train.progress`).
    """
    import torch
    import torch.nn.functional as F

    from .losses import topk_correct
    from .module import TOPK
    from .progress import evaluation_batches, resolve_mode

    model = model.to(device).eval()
    totals = {k: 0 for k in TOPK}
    loss_sum, n = 0.0, 0
    for i, total, y, logits, line in evaluation_batches(model, dm.val_dataloader(), device=device,
                                                        mode=resolve_mode(progress)):
        loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        for k, c in topk_correct(logits, y, TOPK).items():
            totals[k] += int(c)
        n += len(y)
        if line:
            print(f"eval: batch {i}/{total}, {n} images, top-1 so far {100.0 * totals[1] / n:.2f}%", flush=True)
    out = {f"top{k}": 100.0 * totals[k] / max(n, 1) for k in TOPK}
    out.update(loss=loss_sum / max(n, 1), images=n)
    return out


def eval_main(argv: list[str]) -> int:
    """`ssogvit eval --ckpt PATH [--img-size N | H W] [--patch-size P] [--rescale-field] [--ema] [overrides...]`"""
    parser = _checkpoint_parser("eval")
    add_img_size_option(parser, "evaluate at this image size (dynamic resolution; the data's images are square, so "
                                "H W with H = W)")
    parser.add_argument("--patch-size", type=PATCH_SIZE.argparse, default=None,
                        help="convert the model to this patch size first")
    parser.add_argument("--rescale-field", action="store_true",
                        help="with --patch-size and/or --img-size: scale the SSoG centres and widths by the grid ratio "
                        "(evaluation grid over training grid), so each Gaussian covers the same image area")
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of a checkpoint")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    parser.add_argument(OVERWRITE_FLAG, action="store_true", help="replace the --json file if it exists")
    parser.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                        help="auto: a bar on a terminal, plain lines otherwise (default)")
    args, overrides = parser.parse_known_args(argv)
    return report_errors("ssogvit eval", lambda: _eval(args, [*args.img_size_rest, *overrides]))


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from .errors import ConfigError
    from .io import checkpoint_files, holds_ema_weights, load_model, weights_path

    args.ckpt = str(weights_path(args.ckpt))  # a save_pretrained folder stands for its model.safetensors
    other = [o for o in overrides if not split_override(o)[0].startswith("data") or "=" not in o]
    if other:
        raise ConfigError(f"unknown argument {other[0]!r}: eval takes its options and data overrides "
                          f"(data.root=... data.batch_size=...)")
    pair = args.img_size
    if pair is not None and pair[0] != pair[1]:
        raise ConfigError(f"--img-size {pair[0]} {pair[1]}: eval resizes the data to square images; give N, or H W "
                          f"with H = W (`ssogvit export` traces any H W)")
    args.img_size = pair[0] if pair else None
    _refuse_flag_overrides("eval", {"data.img_size": "--img-size"} if args.img_size else {}, overrides)
    if args.rescale_field and not (args.img_size or args.patch_size):
        raise ConfigError("--rescale-field rescales the field to another grid: give --img-size and/or --patch-size")
    check_device(args.device, "--device", compute=True)
    if args.json:  # before any work: an existing file (or the checkpoint itself) is never replaced unasked
        check_output_file(args.json, "--json", overwrite=args.overwrite, inputs=checkpoint_files(args.ckpt))
    model = load_model(args.ckpt, use_ema=args.ema)
    if args.rescale_field and not any(is_ssog(m) for m in model.modules()):
        raise ConfigError(f"--rescale-field rescales SSoG fields, and {args.ckpt} holds a model without one "
                          f"({model.config.get('name', type(model).__name__)}): leave it out")
    trained_grid = tuple(model.grid_size)  # (gh, gw) the model was trained on
    if args.patch_size:
        try:
            model.set_patch_size(args.patch_size, rescale_field=False)
        except ValueError as err:
            raise ConfigError(f"--patch-size {args.patch_size}: {err}") from None
    data = _data_config_for(args.ckpt, overrides, img_size=args.img_size)
    size, patch = int(data["img_size"]), _side(model.patch_size)
    if size % patch:  # refused before any data are read
        near = sorted({max(patch, size // patch * patch), (size // patch + 1) * patch})
        raise ConfigError(f"image size {size} is not a multiple of the patch size {patch}; use --img-size "
                          f"{' or '.join(map(str, near))}, or another --patch-size")
    if args.rescale_field:
        model.rescale_field(size // patch / trained_grid[0], size // patch / trained_grid[1])
    from ssogvit.data import create_datamodule

    data_name = data.pop("name")
    try:
        dm = create_datamodule(data_name, **data)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"the evaluation data cannot be set up: {str(err).splitlines()[0]}") from None
    check_memory(model.forward_bytes(dm.eval_batch_size, size), f"a forward of {dm.eval_batch_size} images of "
                 f"{size} px", "--img-size" if args.img_size else "data.img_size")
    task = getattr(model, "task", "classification")
    if getattr(dm, "task", "classification") != task:
        raise ConfigError(f"{args.ckpt} holds a {task} model but data={data_name} is a "
                          f"{getattr(dm, 'task', 'classification')} dataset")
    try:
        if task == "segmentation":
            from .segmentation import evaluate_segmentation

            result = evaluate_segmentation(model, dm, device=args.device, progress=args.progress)
        else:
            result = evaluate(model, dm, device=args.device, progress=args.progress)
    except (ValueError, RuntimeError) as err:  # the model refuses this input (grid, channels)
        raise ConfigError(f"the model cannot evaluate this data: {str(err).splitlines()[0]}") from None
    patch = getattr(model, "patch_size", None)
    ema = holds_ema_weights(args.ckpt, use_ema=args.ema)  # an EMA export holds EMA weights without --ema
    result.update(ckpt=str(args.ckpt), model=model.config.get("name"), img_size=dm.img_size,
                  patch_size=_side(patch), rescale_field=bool(args.rescale_field), split="validation",
                  weights="ema" if ema else "raw")  # what the figure is of: said, not left to the reader
    if task == "segmentation":
        scores = f"mIoU {result['miou']:.2f}%  pixel accuracy {result['pixel_acc']:.2f}%"
    else:
        scores = f"top-1 {result['top1']:.2f}%  top-3 {result['top3']:.2f}%  top-5 {result['top5']:.2f}%"
    print(f"{result['model']}{' (EMA weights)' if ema else ''} at {result['img_size']} px, patch "
          f"{result['patch_size']}, validation split: {scores}  loss {result['loss']:.4f}  ({result['images']} images)")
    if args.json:
        write_json(args.json, result, overwrite=args.overwrite, default=str)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _side(size: Any) -> int:
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def _data_config_for(ckpt: str, overrides: list[str], *, img_size: int | None) -> dict[str, Any]:
    """The data config of a checkpoint: its saved one with the overrides; an override of an option that decides the
    split (`ssogvit.data.split_settings`) is refused, so the validation images stay those the model did not train on.

    An export's own (the `data` of its `model.json`, sealed with the weights and checked when they were loaded) is
    the one that holds; a checkpoint's is its run's `config.yaml`."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from .config import PATH_KEYS, compose
    from .errors import ConfigError
    from .io import sealed_data_config

    path = Path(ckpt)
    data = sealed_data_config(path)
    for saved in (path.parent.parent / "config.yaml", path.parent / "config.yaml") if data is None else ():
        if saved.is_file():  # a document from disk: bounded, never interpolated (ssogvit.documents.read_document)
            document = read_document(saved, "the run's config")
            data = document.get("data") if isinstance(document, dict) else None
            if data is not None and not isinstance(data, dict):
                raise ConfigError(f"{saved}: its data config is not a mapping")
            if data is not None:
                break
    recorded = None if data is None else dict(data)
    data_overrides = [o for o in overrides if o.startswith("data")]
    if data is None and not any(o.startswith("data=") for o in overrides):
        raise ConfigError(f"no data config beside {path} (its run's config.yaml or the export's .json): name the "
                          f"data, e.g. data=cifar100 data.root=/data")
    if data is None or any(o.startswith("data=") for o in overrides):
        data = OmegaConf.to_container(compose(data_overrides).data, resolve=True)
    else:
        node = OmegaConf.create({"data": data})
        OmegaConf.set_struct(node, True)  # a key the saved data config lacks is an error, not a silent addition
        for o in data_overrides:
            key, value = split_override(o)
            try:
                OmegaConf.update(node, key, value if key in PATH_KEYS else yaml.safe_load(value))
            except Exception as err:  # noqa: BLE001 - OmegaConf's key and validation errors
                raise ConfigError(f"cannot apply {o}: {str(err).splitlines()[0]}") from None
        data = OmegaConf.to_container(node.data, resolve=True)
    if img_size:
        data["img_size"] = img_size
    if recorded is not None:
        _check_same_split(recorded, data)
    return data


def _check_same_split(recorded: dict[str, Any], data: dict[str, Any]) -> None:
    """`ConfigError` if `data` splits the images of the run's data `recorded` otherwise (`split_settings`)."""
    from ssogvit.data import split_settings

    from .errors import ConfigError

    if recorded.get("name") != data.get("name"):  # another dataset: none of its images was trained on here
        return
    run, now = split_settings(str(recorded.get("name")), recorded), split_settings(str(data.get("name")), data)
    for key in run:
        if run[key] != now[key]:
            raise ConfigError(f"data.{key}={now[key]!r}: the checkpoint's run was trained with data.{key}="
                              f"{run[key]!r}, and another split's validation images may be ones the model trained "
                              f"on; evaluate with the run's data.{key}")


def list_main(argv: list[str]) -> int:
    """`ssogvit list [models|mixers|experiments|datasets] [--table N]`"""
    parser = ArgumentParser(prog="ssogvit list", description="List models, mixers, datasets and experiments.")
    parser.add_argument("what", nargs="?", default="all", choices=("all", "models", "mixers", "datasets", "experiments"))
    parser.add_argument("--table", type=Int(1, 1000).argparse, default=None,
                        help="list the experiments of this paper table, each with its row and the paper's Acc@1")
    args = parser.parse_args(argv)
    from .config import experiment_meta, list_experiments

    if args.table is not None:
        return _list_table(args.table)
    if args.what in ("all", "experiments"):
        print("experiments (ssogvit train experiment=<name>):")
        for name in list_experiments():
            meta = experiment_meta(name)
            paper = meta.get("paper") or ""
            print(f"  {name:<44} {paper:<16} {meta.get('description') or ''}")
    if args.what in ("all", "datasets"):
        from ssogvit.data import list_datasets

        print("datasets (data=<name>): " + ", ".join(list_datasets()) + ", imagenet (imagefolder with the DeiT recipe)")
    if args.what in ("all", "mixers"):
        from ssogvit.layers import list_mixers

        print("mixers: " + ", ".join(list_mixers()))
    if args.what in ("all", "models"):
        from ssogvit.models import list_models

        names = list_models()
        print(f"models ({len(names)}, name = family-size-mixer):")
        for i in range(0, len(names), 4):
            print("  " + "  ".join(f"{n:<26}" for n in names[i:i + 4]))
    return 0


def _list_table(table: int) -> int:
    """`ssogvit list experiments --table N`: each run of paper table N, its row and the paper's Acc@1."""
    from .config import experiment_rows

    rows = experiment_rows(table)
    if not rows:
        tables = sorted({r["table"] for r in experiment_rows()})
        print(f"ssogvit list: no experiment reproduces Table {table}; tables with runs: "
              f"{', '.join(map(str, tables))}", file=sys.stderr)
        return 2
    print(f"Table {table} (paper Acc@1; 'missing': not in our copy of the paper's text):")
    for r in rows:
        top1 = "missing" if r["top1"] is None else f"{float(r['top1']):.2f}"
        print(f"  {r['experiment']:<44} {r['row']:<44} {top1:>7}")
    return 0
