"""Your own segmentation data: `root/images/{train,val}/<name>.{png,jpg,jpeg}` and `root/labels/{train,val}/<name>.png`.

The layout of mmsegmentation's custom datasets (`img_dir` / `ann_dir`, ADE20K's `images/` and `annotations/` as
`images/` and `labels/`): an image and its label share the file stem; a label PNG holds one class index per pixel
(mode `L` or `P`, 0 .. num_classes-1), and `ignore_index` (255 by default) for pixels that count nowhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ssogvit.documents import input_folder
from ssogvit.errors import InputError
from ssogvit.specs import IN_CHANS, Int, checked

from ._common import DataError
from ._segmentation import SegmentationDataModule

__all__ = ["SegFolderDataModule", "SegFolder", "find_pairs"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SEGFOLDER_HELP = ("Expected {root}/images/train/<name>.png|jpg with {root}/labels/train/<name>.png, and the same "
                  "under val/ (one class index per label pixel). Pass data.root=<root> and data.num_classes=<n>.")


def find_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """`(image, label)` paths of `split`, sorted by name; a `DataError` names a missing folder, an image without its
    label (or a label without its image), a name that two images share, or a pair whose sizes differ."""
    folders = [root / kind / split for kind in ("images", "labels")]
    for folder in folders:
        try:
            input_folder(folder, "data.root")
        except InputError as err:
            raise DataError(f"{err}. " + SEGFOLDER_HELP.format(root=root)) from None
    images: dict[str, Path] = {}
    for path in sorted(folders[0].iterdir()):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            if path.stem in images:
                raise DataError(f"{images[path.stem]} and {path} share the name {path.stem!r}: keep one")
            images[path.stem] = path
    labels = {p.stem: p for p in folders[1].iterdir() if p.suffix.lower() == ".png"}
    if not images:
        raise DataError(f"{folders[0]} holds no image ({', '.join(IMAGE_SUFFIXES)}). "
                        + SEGFOLDER_HELP.format(root=root))
    unlabelled, orphans = sorted(set(images) - set(labels)), sorted(set(labels) - set(images))
    if unlabelled:
        raise DataError(f"{images[unlabelled[0]]} has no label {folders[1] / (unlabelled[0] + '.png')} "
                        f"({len(unlabelled)} image(s) without a label in {split}/)")
    if orphans:
        raise DataError(f"{labels[orphans[0]]} has no image in {folders[0]} ({len(orphans)} label(s) without an image)")
    pairs = [(images[name], labels[name]) for name in sorted(images)]
    for image, label in pairs:
        sizes = [_size(image), _size(label)]
        if sizes[0] != sizes[1]:
            raise DataError(f"{image} is {sizes[0][0]}x{sizes[0][1]} px but its label {label} is "
                            f"{sizes[1][0]}x{sizes[1][1]}: a label must have its image's size")
    return pairs


def _size(path: Path) -> tuple[int, int]:
    try:
        with Image.open(path) as im:
            return im.size
    except (OSError, SyntaxError, ValueError) as err:
        raise DataError(f"cannot read {path} ({type(err).__name__}: {err}); replace or remove it") from None


class SegFolder(Dataset):
    """Image / label pairs, read on demand; a label value that is neither a class nor `ignore_index` is a
    `DataError` naming the file."""

    def __init__(self, pairs: list[tuple[Path, Path]], *, mode: str, num_classes: int, ignore_index: int,
                 transform=None) -> None:
        self.pairs, self.mode, self.transform = pairs, mode, transform
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        image_path, label_path = self.pairs[i]
        try:
            with Image.open(image_path) as im:
                image = im.convert(self.mode)
            with Image.open(label_path) as lab:
                if lab.mode not in ("L", "P", "I", "I;16"):
                    raise DataError(f"label {label_path} is a {lab.mode} image: a label PNG holds one class index "
                                    f"per pixel (mode L or P)")
                mask = np.asarray(lab, dtype=np.int64)
        except (OSError, SyntaxError, ValueError) as err:
            raise DataError(f"cannot read {image_path} or {label_path} ({type(err).__name__}: {err}); replace or "
                            f"remove the pair, then resume the run") from None
        bad = np.unique(mask[(mask >= self.num_classes) & (mask != self.ignore_index)])
        if bad.size:
            raise DataError(f"label {label_path} holds {bad[0]}, neither a class (0..{self.num_classes - 1}, "
                            f"data.num_classes={self.num_classes}) nor the ignore index {self.ignore_index}")
        return self.transform(image, mask) if self.transform else (image, mask)


class SegFolderDataModule(SegmentationDataModule):
    """Pairs from `root/images/{train,val}` and `root/labels/{train,val}`, resized to `img_size` (square).

    Args:
        root: the dataset folder.
        num_classes: classes of the labels (0 .. num_classes-1).
        in_chans: 3 (RGB) or 1 (grayscale); `aug.mean` / `aug.std` must have as many entries.
    """

    name = "segfolder"

    @checked
    def __init__(self, *, root: str | Path | None = None, num_classes: Annotated[int, Int(1, 65535)] = 2,
                 in_chans: Annotated[int, IN_CHANS] = 3, **kwargs):
        super().__init__(**kwargs)
        if in_chans not in (1, 3):
            raise DataError(f"in_chans={in_chans}: segfolder reads RGB (3) or grayscale (1) images")
        if self.ignore_index < num_classes:
            raise DataError(f"ignore_index={self.ignore_index} is one of the {num_classes} classes: give "
                            f"data.ignore_index >= data.num_classes (255 by default)")
        self.root, self.num_classes, self.in_chans = root, int(num_classes), int(in_chans)
        self.classes = [str(c) for c in range(self.num_classes)]

    def _root(self) -> Path:
        if self.root is None:
            raise DataError("data.root is not set for segfolder. " + SEGFOLDER_HELP.format(root="<root>"))
        return Path(self.root).expanduser()

    def prepare_data(self) -> None:
        for split in ("train", "val"):
            find_pairs(self._root(), split)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        mode = "L" if self.in_chans == 1 else "RGB"
        options = dict(mode=mode, num_classes=self.num_classes, ignore_index=self.ignore_index)
        return (
            SegFolder(find_pairs(self._root(), "train"), transform=self.train_transform(), **options),
            SegFolder(find_pairs(self._root(), "val"), transform=self.eval_transform(), **options),
        )
