"""``ssogvit convert``: turn a trained attention ViT into an SSoG ViT (docs/conversion.md)."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["convert_main"]


def convert_main(argv: list[str]) -> int:
    """``ssogvit convert --teacher PATH [--timm-model NAME] [--calib DIR] [--out DIR] [OVERRIDE ...]``"""
    parser = argparse.ArgumentParser(
        prog="ssogvit convert",
        description="Convert a trained multi-head-attention ViT into its SSoG twin: carry every weight but queries "
        "and keys, fit each head's Gaussian field to the teacher's attention (report in <out>/fit/), then distil. "
        "Remaining arguments are Hydra overrides (conf/convert.yaml): convert.recipe=blocks|logits|progressive, "
        "convert.mixer=ssog-steered, data.*, trainer.max_epochs=..., seed=..., resume=...",
    )
    parser.add_argument("--teacher", required=True, help="teacher .ckpt / .safetensors (or timm weights file)")
    parser.add_argument("--timm-model", default=None, help="the teacher is this timm model (weights from --teacher)")
    parser.add_argument("--timm-kwargs", default=None,
                        help='JSON of timm.create_model arguments, e.g. \'{"num_classes": 10}\'')
    parser.add_argument("--calib", default=None, help="folder of calibration images (default: training images)")
    parser.add_argument("--out", default=None, help="output folder (default runs/<name>)")
    parser.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    args, overrides = parser.parse_known_args(argv)

    from omegaconf import OmegaConf

    from ssogvit.data import DataError
    from ssogvit.train.config import compose
    from ssogvit.train.io import CheckpointError

    try:
        cfg = compose(overrides, config_name="convert")
        # paths and JSON are set after composing, so that no character in them is read as override syntax
        OmegaConf.update(cfg, "convert.teacher", args.teacher)
        if args.timm_model:
            OmegaConf.update(cfg, "convert.timm_model", args.timm_model)
        if args.timm_kwargs:
            OmegaConf.update(cfg, "convert.timm_kwargs", json.loads(args.timm_kwargs), merge=False)
        if args.calib:
            OmegaConf.update(cfg, "convert.calib", args.calib)
        if args.out:
            OmegaConf.update(cfg, "output_dir", args.out)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg, resolve=True))
            return 0
        from .run import convert

        convert(cfg)
    except (ValueError, CheckpointError, DataError) as err:
        print(f"ssogvit convert: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from hydra.errors import HydraException

        if isinstance(err, HydraException):
            print(f"ssogvit convert: {err}", file=sys.stderr)
            return 2
        raise
    return 0
