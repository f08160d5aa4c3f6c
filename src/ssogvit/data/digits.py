"""The embedded default: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), no download."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ssogvit.inputs import SEED, Float, checked

from ._common import ClassificationDataModule

__all__ = ["DigitsDataset", "DigitsDataModule", "load_digits_split"]


def load_digits_split(val_fraction: float = 0.2, split_seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fixed train/validation split: uint8 images `(n, 8, 8)` in [0, 255] and int64 labels.

    The split is stratified by class and depends only on `val_fraction` and `split_seed`.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)  # (1797, 8, 8), values 0..16 -> 0..255
    labels = bunch.target.astype(np.int64)
    rng = np.random.RandomState(split_seed)
    val_idx = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        val_idx.append(idx[: int(round(val_fraction * len(idx)))])
    val_mask = np.zeros(len(labels), dtype=bool)
    val_mask[np.concatenate(val_idx)] = True
    return {"train": (images[~val_mask], labels[~val_mask]), "val": (images[val_mask], labels[val_mask])}


class DigitsDataset(Dataset):
    """8x8 grayscale digits as PIL images (mode "L"), transformed (and upsampled) by `transform`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable | None = None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = Image.fromarray(self.images[i], mode="L")
        return (self.transform(img) if self.transform else img), int(self.labels[i])


class DigitsDataModule(ClassificationDataModule):
    """Digits upsampled to `img_size` (32 by default) with a fixed stratified 80/20 split (1437 / 360 images)."""

    name = "digits"
    in_chans = 1
    num_classes = 10
    classes = [str(d) for d in range(10)]

    @checked
    def __init__(self, *, val_fraction: Annotated[float, Float(0, 1, low_open=True, high_open=True)] = 0.2,
                 split_seed: Annotated[int, SEED] = 0, **kwargs):
        super().__init__(**kwargs)
        self.val_fraction, self.split_seed = val_fraction, split_seed

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        split = load_digits_split(self.val_fraction, self.split_seed)
        return (
            DigitsDataset(*split["train"], transform=self.train_transform()),
            DigitsDataset(*split["val"], transform=self.eval_transform()),
        )
