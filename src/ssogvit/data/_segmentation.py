"""Shared pieces of the segmentation datamodules: joint image + mask transforms (torchvision.transforms.v2, the mask a
`tv_tensors.Mask`, resized with nearest neighbours) and a datamodule base whose batches are `(images, masks)`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from ssogvit.resources import check_memory
from ssogvit.specs import Int, checked

from ._common import ClassificationDataModule, DataConfigError

__all__ = ["IGNORE_INDEX", "SEG_AUG_DEFAULTS", "SegmentationDataModule", "build_joint_transform"]

#: label of pixels that count in neither the loss nor the metrics (VOC's and ADE's convention)
IGNORE_INDEX = 255

#: options of a segmentation data config's `aug:` (joint transforms of image and mask)
SEG_AUG_DEFAULTS: dict[str, Any] = {
    "scale": None,   # RandomResizedCrop scale range of both (null: no crop, the image resized to img_size)
    "ratio": [0.75, 1.3333],
    "hflip": 0.0,    # horizontal flip probability (0 for digits and text)
    "mean": [0.5],
    "std": [0.5],
}


def build_joint_transform(img_size: int, in_chans: int, aug: Mapping[str, Any] | None, *,
                          is_training: bool) -> Callable:
    """`(PIL image, PIL mask) -> (image (C, S, S) float, mask (S, S) int64)`, with torchvision.transforms.v2.

    The image is resized bilinearly, the mask (a `tv_tensors.Mask`) with nearest neighbours, by the same random crop
    and flip when training (`aug.scale`, `aug.hflip`); an unknown `aug` key is a `DataConfigError`.
    """
    import torch
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    unknown = set(aug or {}) - set(SEG_AUG_DEFAULTS)
    if unknown:
        raise DataConfigError(f"unknown aug options {sorted(unknown)}; valid: {sorted(SEG_AUG_DEFAULTS)}")
    options = {**SEG_AUG_DEFAULTS, **dict(aug or {})}
    if len(options["mean"]) != in_chans or len(options["std"]) != in_chans:
        raise DataConfigError(f"aug.mean / aug.std have {len(options['mean'])} / {len(options['std'])} entries but "
                              f"in_chans={in_chans}")
    steps: list[Any] = [v2.ToImage()]
    if is_training and options["scale"] is not None:
        steps.append(v2.RandomResizedCrop(img_size, scale=tuple(options["scale"]), ratio=tuple(options["ratio"]),
                                          antialias=True))
    else:
        steps.append(v2.Resize((img_size, img_size), antialias=True))
    if is_training and options["hflip"]:
        steps.append(v2.RandomHorizontalFlip(float(options["hflip"])))
    steps += [v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None}, scale=True),
              v2.Normalize(mean=list(options["mean"]), std=list(options["std"]))]
    compose = v2.Compose(steps)

    def transform(image: Any, mask: Any) -> tuple[Any, Any]:
        x, y = compose(image, tv_tensors.Mask(torch.as_tensor(_array(mask))[None]))
        return x.as_subclass(torch.Tensor), y[0].as_subclass(torch.Tensor)

    return transform


def _array(mask: Any) -> Any:
    import numpy as np

    return np.asarray(mask, dtype=np.int64)


class SegmentationDataModule(ClassificationDataModule):
    """A datamodule of `(image (C, S, S), mask (S, S) int64)` pairs; a mask holds class indices and `ignore_index`.

    Subclasses set `num_classes`, `in_chans`, `classes` and implement `build_datasets()`, as for classification.
    """

    task = "segmentation"

    @checked
    def __init__(self, *, ignore_index: Annotated[int, Int(0, 65535)] = IGNORE_INDEX, **kwargs):
        super().__init__(**kwargs)
        self.ignore_index = int(ignore_index)

    def train_transform(self) -> Callable:
        return build_joint_transform(self.img_size, self.in_chans, self.aug, is_training=True)

    def eval_transform(self) -> Callable:
        return build_joint_transform(self.img_size, self.in_chans, self.aug, is_training=False)

    def batch_bytes(self) -> int:
        """Bytes of the largest batch the loaders hand out: images (float32) and masks (int64)."""
        return max(self.batch_size, self.eval_batch_size) * (int(self.in_chans) * 4 + 8) * self.img_size**2

    def check_memory(self) -> None:
        """Refuse (`MemoryLimitError`) a batch of images and masks that cannot fit in this machine's memory."""
        check_memory(self.batch_bytes(), f"a batch of {max(self.batch_size, self.eval_batch_size)} images and masks "
                     f"of {self.img_size}x{self.img_size}", "data.img_size and data.batch_size")
