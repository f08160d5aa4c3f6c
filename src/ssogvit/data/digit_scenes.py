"""Digit scenes: semantic segmentation built from the embedded digits (scikit-learn's 8x8 digits), no download.

Each scene is a black canvas of `img_size` px with a few digits scaled and placed on it, drawn in turn (a later digit
covers an earlier one where they overlap). Labels per pixel: 0 the background, `1 + d` for digit `d` (so 1..10
for the digits 0..9; 11 classes), where the upsampled digit is brighter than `ink` (of 255); no pixel is ignored.

A scene is a pure function of `(seed, split, index)`: its digits, their sizes (fractions of the canvas side) and
places (fractions too), so the same scenes come back at any canvas size (`ssogvit eval --img-size`). Training scenes
take their digits from the training images of the digits datamodule's split, validation scenes from its validation
images (`load_digits_split`): no source image is in both.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ssogvit.specs import SEED, Float, Int, IntOrPair, checked

from ._common import DataConfigError
from ._segmentation import SegmentationDataModule
from .digits import load_digits_split

__all__ = ["DigitScenes", "DigitScenesDataModule", "render_scene", "BACKGROUND"]

BACKGROUND = 0
_SPLITS = {"train": 0, "val": 1}


def render_scene(images: np.ndarray, labels: np.ndarray, *, size: int, index: int, seed: int, split: str,
                 digits: tuple[int, int], scale: tuple[float, float], ink: int) -> tuple[np.ndarray, np.ndarray]:
    """Scene `index` of `split`: `(image (size, size) uint8, mask (size, size) int64)`.

    Args:
        images, labels: the source digits `(n, 8, 8)` uint8 and their classes.
        size: canvas side in pixels.
        digits: fewest and most digits per scene.
        scale: smallest and largest digit side, as fractions of the canvas side.
        ink: brightness (of 255) from which an upsampled digit's pixel is labelled as the digit.
    """
    rng = np.random.default_rng([seed, _SPLITS[split], index])
    count = int(rng.integers(digits[0], digits[1] + 1))
    picks = rng.integers(len(labels), size=count)
    sides = rng.uniform(scale[0], scale[1], size=count)
    corners = rng.uniform(0.0, 1.0, size=(count, 2))  # where in the room left by the digit, as a fraction
    image = np.zeros((size, size), dtype=np.uint8)
    mask = np.full((size, size), BACKGROUND, dtype=np.int64)
    for pick, frac, (fy, fx) in zip(picks, sides, corners):
        side = max(1, int(round(frac * size)))
        y0, x0 = int(fy * (size - side)), int(fx * (size - side))
        digit = np.asarray(Image.fromarray(images[pick], mode="L").resize((side, side), Image.BILINEAR))
        window = (slice(y0, y0 + side), slice(x0, x0 + side))
        image[window] = np.where(digit > 0, digit, image[window])
        mask[window] = np.where(digit > ink, 1 + int(labels[pick]), np.where(digit > 0, BACKGROUND, mask[window]))
    return image, mask


class DigitScenes(Dataset):
    """`num_scenes` scenes of one split, rendered on demand, transformed jointly (image, mask) by `transform`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, split: str, num_scenes: int, transform=None,
                 **scene_options) -> None:
        self.images, self.labels, self.split = images, labels, split
        self.num_scenes, self.transform, self.scene_options = num_scenes, transform, scene_options

    def __len__(self) -> int:
        return self.num_scenes

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = render_scene(self.images, self.labels, index=int(i), split=self.split, **self.scene_options)
        image = Image.fromarray(image, mode="L")
        return self.transform(image, mask) if self.transform else (image, mask)


class DigitScenesDataModule(SegmentationDataModule):
    """Digit scenes of `img_size` px (canvas side; 256 to 2048 in the experiments, any size that the patch divides).

    Args:
        digits_per_scene: fewest and most digits in a scene.
        scale: smallest and largest digit side, as fractions of the canvas side.
        num_train_scenes, num_val_scenes: scenes per split.
        scene_seed: the scenes' seed (not the run's: the same scenes whatever `seed` the run trains with).
        ink: brightness (of 255) from which an upsampled digit's pixel is labelled as the digit.
        val_fraction, split_seed: the digits datamodule's split of the source images.
    """

    name = "digit_scenes"
    split_options = ("val_fraction", "split_seed")
    in_chans = 1
    num_classes = 11
    classes = ["background"] + [str(d) for d in range(10)]

    @checked
    def __init__(self, *, digits_per_scene: Annotated[int | tuple[int, int], IntOrPair(Int(1, 64))] = (2, 5),
                 scale: list[float] | tuple[float, float] | None = None,
                 num_train_scenes: Annotated[int, Int(1, 10_000_000)] = 2000,
                 num_val_scenes: Annotated[int, Int(1, 10_000_000)] = 200,
                 scene_seed: Annotated[int, SEED] = 0, ink: Annotated[int, Int(0, 254)] = 64,
                 val_fraction: Annotated[float, Float(0, 1, low_open=True, high_open=True)] = 0.2,
                 split_seed: Annotated[int, SEED] = 0, **kwargs):
        super().__init__(**kwargs)
        low, high = (digits_per_scene, digits_per_scene) if isinstance(digits_per_scene, int) else digits_per_scene
        if low > high:
            raise DataConfigError(f"digits_per_scene={list(digits_per_scene)}: the fewest is more than the most")
        self.digits_per_scene = (int(low), int(high))
        self.scale = _scale_range(scale)
        if round(self.scale[0] * self.img_size) < 4:
            raise DataConfigError(f"scale={list(self.scale)} at img_size={self.img_size}: the smallest digit would be "
                                  f"under 4 px; raise data.scale or data.img_size")
        self.num_train_scenes, self.num_val_scenes = int(num_train_scenes), int(num_val_scenes)
        self.scene_seed, self.ink = int(scene_seed), int(ink)
        self.val_fraction, self.split_seed = val_fraction, split_seed

    def scene_options(self) -> dict:
        return dict(size=self.img_size, seed=self.scene_seed, digits=self.digits_per_scene, scale=self.scale,
                    ink=self.ink)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        split = load_digits_split(self.val_fraction, self.split_seed, test_fraction=0)  # scenes: train / val only
        return (
            DigitScenes(*split["train"], split="train", num_scenes=self.num_train_scenes,
                        transform=self.train_transform(), **self.scene_options()),
            DigitScenes(*split["val"], split="val", num_scenes=self.num_val_scenes,
                        transform=self.eval_transform(), **self.scene_options()),
        )


def _scale_range(scale) -> tuple[float, float]:
    """`scale` as `(low, high)` fractions of the canvas side, `0 < low <= high <= 1`; default `(0.12, 0.3)`."""
    if scale is None:
        return (0.12, 0.3)
    spec = Float(0, 1, low_open=True)
    if not isinstance(scale, (list, tuple)) or len(scale) != 2:
        raise DataConfigError(f"scale={scale!r}: expected [low, high], fractions of the canvas side in (0, 1]")
    low, high = (spec.check(v, "scale") for v in scale)
    if low > high:
        raise DataConfigError(f"scale={list(scale)}: low is more than high")
    return (low, high)
