"""ImageNet-style folders: `root/train/<class>/<image>` and `root/val/<class>/<image>`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from torch.utils.data import Dataset

from ssogvit.specs import IN_CHANS, Int, Text, checked

from ._common import ClassificationDataModule, DataError

__all__ = ["ImageFolderDataModule"]

IMAGEFOLDER_HELP = (
    "Expected {root}/train/<class>/*.JPEG and {root}/val/<class>/*.JPEG with the same class folders in both\n"
    "(for ImageNet-1k: the train archive as distributed, and the validation images sorted into class folders,\n"
    "e.g. with the valprep.sh script that many ImageNet guides provide). Pass data.root=<root>."
)


class ImageFolderDataModule(ClassificationDataModule):
    """`torchvision.datasets.ImageFolder` over `train/` and `val/` (class index = sorted folder name)."""

    name = "imagefolder"
    split_options = ("train_dir", "val_dir")

    @checked
    def __init__(self, *, root: str | Path | None = None, in_chans: Annotated[int, IN_CHANS] = 3,
                 num_classes: Annotated[int | None, Int(1, 1_000_000, none=True)] = None,
                 train_dir: Annotated[str, Text()] = "train", val_dir: Annotated[str, Text()] = "val", **kwargs):
        super().__init__(**kwargs)
        self.root, self.train_dir, self.val_dir = root, train_dir, val_dir
        self.in_chans = int(in_chans)
        self.expected_classes = num_classes
        self.classes: list[str] = []
        if self.root is not None and num_classes is None:
            self.num_classes = len(self._class_names())
        else:
            self.num_classes = int(num_classes or 0)

    def _folder(self, sub: str) -> Path:
        if self.root is None:
            raise DataError("data.root is not set for imagefolder.\n" + IMAGEFOLDER_HELP.format(root="<root>"))
        path = Path(self.root).expanduser() / sub
        if not path.is_dir():
            raise DataError(f"{path} does not exist.\n" + IMAGEFOLDER_HELP.format(root=self.root))
        return path

    def _class_names(self) -> list[str]:
        names = {}
        for sub in (self.train_dir, self.val_dir):
            names[sub] = sorted(p.name for p in self._folder(sub).iterdir() if p.is_dir())
        if names[self.train_dir] != names[self.val_dir] or not names[self.train_dir]:
            raise DataError(
                f"class folders differ or are empty: {len(names[self.train_dir])} in {self.train_dir}/, "
                f"{len(names[self.val_dir])} in {self.val_dir}/.\n" + IMAGEFOLDER_HELP.format(root=self.root)
            )
        return names[self.train_dir]

    def prepare_data(self) -> None:
        from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

        for sub in (self.train_dir, self.val_dir):
            for name in self._class_names():  # an empty class would otherwise fail only when the run has started
                folder = self._folder(sub) / name
                if not any(has_file_allowed_extension(p.name, IMG_EXTENSIONS) for p in folder.iterdir()):
                    raise DataError(f"class folder {folder} holds no image ({', '.join(IMG_EXTENSIONS[:4])}, ...); "
                                    f"add its images or remove the class from both {self.train_dir}/ and "
                                    f"{self.val_dir}/")

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        from torchvision.datasets import ImageFolder

        self.classes = self._class_names()
        if self.expected_classes is not None and len(self.classes) != self.expected_classes:
            raise DataError(f"{self.root} has {len(self.classes)} classes; the config says {self.expected_classes}")
        mode = "L" if self.in_chans == 1 else "RGB"

        def loader(path: str):
            from PIL import Image

            try:
                with open(path, "rb") as f:
                    return Image.open(f).convert(mode)
            except (OSError, SyntaxError, ValueError) as err:  # PIL's errors for a truncated or corrupt file
                raise DataError(f"cannot read image {path} ({type(err).__name__}: {err}); replace or remove the "
                                f"file, then resume the run") from None

        train = ImageFolder(str(self._folder(self.train_dir)), transform=self.train_transform(), loader=loader)
        val = ImageFolder(str(self._folder(self.val_dir)), transform=self.eval_transform(), loader=loader)
        return train, val
