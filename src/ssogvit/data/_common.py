"""Shared pieces of the datamodules: timm transforms, a Lightning datamodule over two datasets."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ssogvit.errors import UserError
from ssogvit.resources import check_memory
from ssogvit.specs import BATCH_SIZE, IMG_SIZE, NUM_WORKERS, Flag, Int, checked

__all__ = ["DataError", "DataConfigError", "ClassificationDataModule", "build_transform", "AUG_DEFAULTS"]


class DataError(UserError, RuntimeError):
    """A dataset is missing or not in the expected format; the message says how to fix it."""


class DataConfigError(DataError, ValueError):
    """A data config asks for something the dataset does not have (an unknown option, a wrong class count)."""


# Options of timm.data.create_transform that a data config may set (under `aug:`), with their defaults here.
AUG_DEFAULTS: dict[str, Any] = {
    "scale": None,  # RandomResizedCrop scale range; timm's default (0.08, 1.0)
    "ratio": None,
    "hflip": 0.5,
    "color_jitter": 0.4,
    "auto_augment": None,  # e.g. "rand-m9-mstd0.5-inc1" (DeiT)
    "re_prob": 0.0,  # random erasing
    "re_mode": "pixel",
    "re_count": 1,
    "interpolation": "bicubic",
    "crop_pct": None,
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
}


def build_transform(img_size: int, in_chans: int, aug: Mapping[str, Any] | None, *, is_training: bool) -> Callable:
    """The timm transform (`timm.data.create_transform`) for PIL images, DeiT-style when training.

    Args:
        img_size: output side in pixels.
        in_chans: channels of the output tensor (1 for grayscale, 3 for RGB); `mean`/`std` must match.
        aug: overrides of `AUG_DEFAULTS`; an unknown key is a `ValueError`.
        is_training: random crop / flip / RandAugment / random erasing when True, resize + centre crop otherwise.
    """
    from timm.data import create_transform

    options = dict(AUG_DEFAULTS)
    unknown = set(aug or {}) - set(AUG_DEFAULTS)
    if unknown:
        raise DataConfigError(f"unknown aug options {sorted(unknown)}; valid: {sorted(AUG_DEFAULTS)}")
    options.update({k: v for k, v in (aug or {}).items()})
    mean, std = tuple(options.pop("mean")), tuple(options.pop("std"))
    if len(mean) != in_chans or len(std) != in_chans:
        raise ValueError(f"mean/std have {len(mean)}/{len(std)} entries but in_chans={in_chans}")
    scale, ratio = options.pop("scale"), options.pop("ratio")
    crop_pct = options.pop("crop_pct")
    jitter = options["color_jitter"]
    if jitter is not None and not any(float(j) for j in (jitter if isinstance(jitter, Sequence) else [jitter])):
        options["color_jitter"] = None  # timm adds a ColorJitter that changes nothing for 0 (and draws from the RNG)
    if not is_training:
        return create_transform(
            (in_chans, img_size, img_size), is_training=False, interpolation=options["interpolation"],
            mean=mean, std=std, crop_pct=crop_pct,
        )
    return create_transform(
        (in_chans, img_size, img_size), is_training=True, mean=mean, std=std,
        scale=tuple(scale) if scale is not None else None, ratio=tuple(ratio) if ratio is not None else None,
        **options,
    )


class ClassificationDataModule(pl.LightningDataModule):
    """A datamodule over a train and a validation dataset that a subclass builds in `build_datasets()`.

    Subclasses set `num_classes`, `in_chans`, `classes` and implement `build_datasets() -> (train, val)`.
    Under DDP Lightning replaces the samplers with distributed ones.
    """

    name = "base"

    @checked
    def __init__(
        self,
        *,
        img_size: Annotated[int, IMG_SIZE],
        batch_size: Annotated[int, BATCH_SIZE] = 64,
        eval_batch_size: Annotated[int | None, Int(1, 1 << 20, none=True)] = None,
        num_workers: Annotated[int, NUM_WORKERS] = 0,
        aug: Mapping[str, Any] | None = None,
        drop_last: Annotated[bool, Flag()] = True,
        pin_memory: Annotated[bool | None, Flag(none=True)] = None,
    ):
        super().__init__()
        self.img_size = int(img_size)
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.aug = dict(aug or {})
        self.drop_last = drop_last
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None  # a held-out split, where the dataset has one (digits)

    # subclasses ---------------------------------------------------------------------------------------------------
    in_chans: int = 3
    num_classes: int = 0
    classes: list[str] = []
    #: the options that decide which images are in which split: a model evaluated with other values than it was
    #: trained with may be scored on its own training images (`ssogvit eval` refuses it, `split_settings`)
    split_options: tuple[str, ...] = ()

    def build_datasets(self) -> tuple[Dataset, ...]:
        """`(train, val)`, or `(train, val, test)` for a dataset with a held-out test split."""
        raise NotImplementedError

    # Lightning ----------------------------------------------------------------------------------------------------
    def train_transform(self) -> Callable:
        return build_transform(self.img_size, self.in_chans, self.aug, is_training=True)

    def eval_transform(self) -> Callable:
        return build_transform(self.img_size, self.in_chans, self.aug, is_training=False)

    def batch_bytes(self) -> int:
        """Bytes of the largest batch of images the loaders hand out (float32, `(B, C, S, S)`)."""
        return max(self.batch_size, self.eval_batch_size) * int(self.in_chans) * self.img_size**2 * 4

    def check_memory(self) -> None:
        """Refuse (`MemoryLimitError`) a batch of images that cannot fit in this machine's memory."""
        check_memory(self.batch_bytes(), f"a batch of {max(self.batch_size, self.eval_batch_size)} images of "
                     f"{self.in_chans}x{self.img_size}x{self.img_size}", "data.img_size and data.batch_size")

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets once; refused first (`check_memory`) if one batch of images cannot fit in memory."""
        if self.train_set is None:
            self.check_memory()
            self.train_set, self.val_set, *test = self.build_datasets()
            self.test_set = test[0] if test else None

    def _loader(self, dataset: Dataset, *, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            drop_last=train and self.drop_last,
            num_workers=self.num_workers,
            persistent_workers=False,  # fresh workers each epoch, seeded from the (checkpointed) torch RNG: exact resume
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, train=False)

    @property
    def has_test(self) -> bool:
        """Whether the dataset has a held-out test split (`test_dataloader` reads it)."""
        self.setup("test")
        return self.test_set is not None

    def test_dataloader(self) -> DataLoader:
        """The held-out test split; a dataset without one has no test loader (its validation split is not one)."""
        if not self.has_test:
            raise ValueError(f"the {self.name} data have no test split")
        return self._loader(self.test_set, train=False)
