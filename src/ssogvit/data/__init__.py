"""Datamodules: `digits` (embedded default), `cifar100`, `imagefolder` (ImageNet-style), `synthetic`; for
segmentation `digit_scenes` (embedded) and `segfolder` (images and label PNGs).

`create_datamodule(name, **options)` builds one from a data config (the `data:` node of a run config, minus the
keys that only describe it: `name`, `num_classes` for fixed datasets, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ._common import AUG_DEFAULTS, ClassificationDataModule, DataConfigError, DataError, build_transform
from .cifar100 import Cifar100DataModule, find_cifar100, read_cifar100_split
from ._segmentation import IGNORE_INDEX, SegmentationDataModule, build_joint_transform
from .digit_scenes import DigitScenesDataModule, render_scene
from .digits import DigitsDataModule, load_digits_split
from .segfolder import SegFolderDataModule
from .imagefolder import ImageFolderDataModule
from .synthetic import SyntheticDataModule, SyntheticDataset

__all__ = [
    "AUG_DEFAULTS", "ClassificationDataModule", "DataError", "DataConfigError",
    "build_transform", "create_datamodule", "list_datasets",
    "DigitsDataModule", "Cifar100DataModule", "ImageFolderDataModule", "SyntheticDataModule", "SyntheticDataset",
    "find_cifar100", "read_cifar100_split", "load_digits_split", "DATAMODULES", "split_settings",
    "IGNORE_INDEX", "SegmentationDataModule", "DigitScenesDataModule", "SegFolderDataModule", "build_joint_transform",
    "render_scene",
]

DATAMODULES: dict[str, type[ClassificationDataModule]] = {
    "digits": DigitsDataModule,
    "cifar100": Cifar100DataModule,
    "imagefolder": ImageFolderDataModule,
    "synthetic": SyntheticDataModule,
    "digit_scenes": DigitScenesDataModule,
    "segfolder": SegFolderDataModule,
}

# Keys of a data config that describe the dataset rather than configure its module (checked, not passed).
_DESCRIPTIVE = {"name", "num_classes", "in_chans"}


def list_datasets() -> list[str]:
    return sorted(DATAMODULES)


def create_datamodule(name: str, **options: Any) -> ClassificationDataModule:
    """Build the datamodule `name` with `options` (img_size, batch_size, num_workers, aug, root, ...).

    `num_classes` / `in_chans` are accepted for every dataset: they configure `imagefolder` and `synthetic` and are
    checked against the fixed values of `digits` and `cifar100`.
    """
    if name not in DATAMODULES:
        raise DataConfigError(f"unknown dataset {name!r}; valid: {list_datasets()}")
    cls = DATAMODULES[name]
    options = {k: v for k, v in options.items() if v is not None}
    fixed = {k: options.pop(k) for k in list(options) if k in _DESCRIPTIVE}
    fixed.pop("name", None)
    if cls in (DigitsDataModule, Cifar100DataModule, DigitScenesDataModule):
        for key, value in fixed.items():
            if int(value) != int(getattr(cls, key)):
                raise DataConfigError(f"{name} has {key}={getattr(cls, key)}, the config says {value}")
    else:
        options.update(fixed)
    unknown = sorted(set(options) - _options_of(cls))
    if unknown:
        hint = " (the digits are embedded in scikit-learn: there is no root to set)" if name == "digits" else ""
        raise DataConfigError(f"data={name} has no option {', '.join(unknown)}{hint}; its options: "
                              f"{', '.join(sorted(_options_of(cls)))}")
    if isinstance(options.get("aug"), Mapping):
        options["aug"] = dict(options["aug"])
    dm = cls(**options)
    dm.check_memory()  # before any model is built for these images
    return dm


def split_settings(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the options that decide `name`'s split (its datamodule's `split_options`) in a data config
    `options`, an option left out at its default: two configs whose split settings differ split the images
    differently (one's validation images may be the other's training images)."""
    cls = DATAMODULES.get(name)
    if cls is None:
        return {}
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass):
            params = inspect.signature(vars(klass)["__init__"]).parameters.values()
            defaults.update({p.name: p.default for p in params if p.default is not p.empty})
    return {k: options[k] if options.get(k) is not None else defaults.get(k) for k in cls.split_options}


def _options_of(cls: type) -> set[str]:
    """The keyword options a datamodule class takes, its base classes' included."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and issubclass(klass, ClassificationDataModule):
            params = inspect.signature(vars(klass)["__init__"]).parameters.values()
            names |= {p.name for p in params if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD
                                                                              and p.name != "self")}
    return names
