"""Random images for tests and benchmarks: deterministic per index, already normalised tensors."""

from __future__ import annotations

from typing import Annotated

import torch
from torch.utils.data import Dataset

from ssogvit.specs import IN_CHANS, SEED, Flag, Int, checked

from ._common import ClassificationDataModule

__all__ = ["SyntheticDataset", "SyntheticDataModule"]


class SyntheticDataset(Dataset):
    """`length` images `(in_chans, img_size, img_size)` ~ N(0, 1) and uniform labels, a pure function of (seed, i).

    With `learnable=True` each image also carries a class-dependent constant offset on its first channel, so a
    model can fit it (useful to check that training lowers the loss).
    """

    def __init__(self, length: int, img_size: int, in_chans: int, num_classes: int, *, seed: int = 0,
                 learnable: bool = False):
        self.length, self.img_size, self.in_chans, self.num_classes = length, img_size, in_chans, num_classes
        self.seed, self.learnable = seed, learnable

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(self.num_classes, (), generator=g))
        x = torch.randn(self.in_chans, self.img_size, self.img_size, generator=g)
        if self.learnable:
            x[0] += 2.0 * (label / max(self.num_classes - 1, 1)) - 1.0
        return x, label


class SyntheticDataModule(ClassificationDataModule):
    """Synthetic train / val sets of `train_size` / `val_size` images (no transform, no files)."""

    name = "synthetic"
    split_options = ("seed",)  # the validation images are those of seed + 1

    @checked
    def __init__(self, *, num_classes: Annotated[int, Int(1, 1_000_000)] = 10, in_chans: Annotated[int, IN_CHANS] = 3,
                 train_size: Annotated[int, Int(1)] = 256, val_size: Annotated[int, Int(1)] = 64,
                 seed: Annotated[int, SEED] = 0, learnable: Annotated[bool, Flag()] = False, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.in_chans = int(num_classes), int(in_chans)
        self.classes = [str(c) for c in range(self.num_classes)]
        self.train_size, self.val_size, self.seed, self.learnable = train_size, val_size, seed, learnable

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        common = dict(img_size=self.img_size, in_chans=self.in_chans, num_classes=self.num_classes,
                      learnable=self.learnable)
        return (
            SyntheticDataset(self.train_size, seed=self.seed, **common),
            SyntheticDataset(self.val_size, seed=self.seed + 1, **common),
        )
