"""The embedded default: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), no download."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ssogvit.specs import SEED, Float, checked

from ._common import ClassificationDataModule

__all__ = ["DigitsDataset", "DigitsDataModule", "load_digits_split"]


def load_digits_split(val_fraction: float = 0.15, split_seed: int = 0, test_fraction: float = 0.15,
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fixed train / validation / test split: uint8 images `(n, 8, 8)` in [0, 255] and int64 labels.

    Stratified by class: each class's images are shuffled once (`split_seed`), the first `test_fraction` of them
    go to "test", the next `val_fraction` to "val", the rest to "train". It depends only on the two fractions and
    `split_seed`, and the test images do not depend on `val_fraction`. With the defaults: 1259 / 269 / 269 images.
    `test_fraction=0` gives no "test" entry (the split of earlier versions, train / val only, with the same val).
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)  # (1797, 8, 8), values 0..16 -> 0..255
    labels = bunch.target.astype(np.int64)
    rng = np.random.RandomState(split_seed)
    part = np.zeros(len(labels), dtype=np.int64)  # 0 train, 1 val, 2 test
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_test = int(round(test_fraction * len(idx)))
        n_val = int(round(val_fraction * len(idx)))
        part[idx[n_test:n_test + n_val]] = 1
        part[idx[:n_test]] = 2
    names = ("train", "val", "test") if test_fraction > 0 else ("train", "val")
    return {name: (images[part == k], labels[part == k]) for k, name in enumerate(names)}


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
    """Digits at `img_size` with a fixed stratified train / validation / test split (`load_digits_split`; by default
    70 / 15 / 15 %: 1259 / 269 / 269 images). Hyper-parameters are chosen on validation; the test images are only
    read by `test_dataloader` (a run's final evaluation, docs/training.md "How comparisons are made")."""

    name = "digits"
    in_chans = 1
    num_classes = 10
    classes = [str(d) for d in range(10)]
    split_options = ("val_fraction", "test_fraction", "split_seed")

    @checked
    def __init__(self, *, val_fraction: Annotated[float, Float(0, 1, low_open=True, high_open=True)] = 0.15,
                 test_fraction: Annotated[float, Float(0, 1, high_open=True)] = 0.15,
                 split_seed: Annotated[int, SEED] = 0, **kwargs):
        super().__init__(**kwargs)
        if val_fraction + test_fraction >= 1:
            raise ValueError(f"val_fraction + test_fraction must leave training images: got {val_fraction} + "
                             f"{test_fraction} >= 1")
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed

    def build_datasets(self) -> tuple[Dataset, ...]:
        split = load_digits_split(self.val_fraction, self.split_seed, self.test_fraction)
        train = DigitsDataset(*split["train"], transform=self.train_transform())
        return train, *(DigitsDataset(*split[k], transform=self.eval_transform()) for k in ("val", "test") if k in split)
