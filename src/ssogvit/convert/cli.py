"""``ssogvit convert``: turn a trained attention ViT into an SSoG ViT (docs/conversion.md)."""

from __future__ import annotations

import json

__all__ = ["convert_main", "UNUSED_KEYS"]

#: groups of the base run config a conversion does not read (an override of them would be silently ignored)
UNUSED_KEYS = ("model", "experiment", "transfer", "ema", "mixup")


def convert_main(argv: list[str]) -> int:
    """``ssogvit convert --teacher PATH [--timm-model NAME] [--calib DIR] [--out DIR] [HYDRA ARGS ...]``"""
    from ssogvit.errors import UsageError
    from ssogvit.errors import ArgumentParser
    from ssogvit.train.cli import run_config_command

    parser = ArgumentParser(
        prog="ssogvit convert",
        description="Convert a trained multi-head-attention ViT into its SSoG twin: carry every weight but queries "
        "and keys, fit each head's Gaussian field to the teacher's attention (report in <out>/fit/), then distil. "
        "Remaining arguments are Hydra's command line as for `ssogvit train` (conf/convert.yaml): overrides such as "
        "convert.recipe=blocks|logits|progressive, convert.mixer=ssog-steered, data.*, trainer.max_epochs=..., "
        "seed=..., resume=...; -m sweeps; --cfg job (or --print-config).",
        add_help=False,
    )
    parser.add_argument("--teacher", required=not {"-h", "--help"} & set(argv),
                        help="teacher .ckpt / .safetensors (or timm weights file)")
    parser.add_argument("--timm-model", default=None, help="the teacher is this timm model (weights from --teacher)")
    parser.add_argument("--timm-kwargs", default=None,
                        help='JSON of timm.create_model arguments, e.g. \'{"num_classes": 10}\'')
    parser.add_argument("--calib", default=None, help="folder of calibration images (default: training images)")
    parser.add_argument("--out", default=None, help="output folder (default runs/<name>)")
    args, rest = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(argv):
        parser.print_help()
        print("\nHydra's own options (-m, --cfg, --resolve, ...) follow; see `ssogvit train --help`.")
        return 0
    timm_kwargs = None
    if args.timm_kwargs:
        try:
            timm_kwargs = json.loads(args.timm_kwargs)
        except json.JSONDecodeError as err:
            parser.error(f"--timm-kwargs is not JSON ({err}); expected e.g. '{{\"num_classes\": 10}}'")
        if not isinstance(timm_kwargs, dict):
            parser.error("--timm-kwargs must be a JSON object, e.g. '{\"num_classes\": 10}'")
    overrides = [f"convert.teacher={args.teacher}"]  # path keys are taken literally (train.config.PATH_KEYS)
    overrides += [f"convert.timm_model={args.timm_model}"] if args.timm_model else []
    overrides += [f"convert.calib={args.calib}"] if args.calib else []
    overrides += [f"output_dir={args.out}"] if args.out else []

    def task(cfg) -> int:
        from omegaconf import OmegaConf

        from ssogvit.train.config import split_override
        from ssogvit.train.hydra_app import task_overrides

        from .run import convert

        unused = [o for o in task_overrides() if split_override(o)[0].split(".")[0] in UNUSED_KEYS]
        if unused:  # accepted by the base config, but a conversion never reads them
            raise UsageError(f"{unused[0]} has no effect on a conversion: the student is built from the teacher "
                             "(its mixer: convert.mixer, convert.mixer_options) and distilled with optim, sched and "
                             "loss.smoothing; leave out " + ", ".join(sorted(set(UNUSED_KEYS))) + " overrides")
        if timm_kwargs is not None:
            OmegaConf.update(cfg, "convert.timm_kwargs", timm_kwargs, merge=False)
        try:
            convert(cfg)
        except ValueError as err:  # a teacher, option or data the conversion refuses (docs/conversion.md)
            raise UsageError(str(err)) from err
        return 0

    return run_config_command("ssogvit convert", rest, task, overrides=overrides, config_name="convert")
