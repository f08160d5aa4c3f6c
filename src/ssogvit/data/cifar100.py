"""CIFAR-100 from the standard `cifar-100-python` folder (the "python version" of the dataset).

The folder holds three pickles, `train`, `test` and `meta`. They are read with a restricted unpickler that only
rebuilds plain containers and numpy arrays, so a tampered file cannot run code.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ._common import ClassificationDataModule, DataError

__all__ = ["Cifar100Dataset", "Cifar100DataModule", "find_cifar100", "read_cifar100_split", "CIFAR100_HELP"]

CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_HELP = (
    "Get the 'CIFAR-100 python version' archive from {url} (161 MB), then run\n"
    "    tar xzf cifar-100-python.tar.gz -C {root}\n"
    "so that {root}/cifar-100-python/ holds the files 'train', 'test' and 'meta', and pass data.root={root}\n"
    "(data.root may also point at the cifar-100-python folder itself)."
)

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} from a dataset file")


def _load_pickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return _SafeUnpickler(f, encoding="bytes").load()


def find_cifar100(root: str | Path | None) -> Path:
    """The `cifar-100-python` folder under (or at) `root`; a `DataError` saying where to get it if absent."""
    if root is None:
        raise DataError("data.root is not set for cifar100.\n" + CIFAR100_HELP.format(url=CIFAR100_URL, root="<root>"))
    root = Path(root).expanduser()
    for candidate in (root / "cifar-100-python", root):
        if all((candidate / f).is_file() for f in ("train", "test", "meta")):
            return candidate
    raise DataError(
        f"CIFAR-100 not found: neither {root / 'cifar-100-python'} nor {root} holds 'train', 'test' and 'meta'.\n"
        + CIFAR100_HELP.format(url=CIFAR100_URL, root=root)
    )


def _key(d: dict, name: str):
    for k in (name.encode(), name):
        if k in d:
            return d[k]
    raise KeyError(name)


def read_cifar100_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Images `(n, 32, 32, 3)` uint8, fine labels `(n,)` int64 and the 100 fine class names of one split."""
    path = folder / split
    try:
        batch, meta = _load_pickle(path), _load_pickle(folder / "meta")
        data = np.asarray(_key(batch, "data"), dtype=np.uint8)
        labels = np.asarray(_key(batch, "fine_labels"), dtype=np.int64)
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in _key(meta, "fine_label_names")]
        if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
            raise ValueError(f"'data' has shape {data.shape} and {len(labels)} labels; expected (n, 3072) and n")
        if len(names) != 100 or labels.min() < 0 or labels.max() >= 100:
            raise ValueError(f"{len(names)} class names, labels in [{labels.min()}, {labels.max()}]; expected 100")
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError) as err:
        raise DataError(
            f"{path} is not a CIFAR-100 python pickle ({type(err).__name__}: {err}).\n"
            + CIFAR100_HELP.format(url=CIFAR100_URL, root=folder.parent)
        ) from err
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (n, 32, 32, 3): channel-major rows in the file
    return np.ascontiguousarray(images), labels, names


class Cifar100Dataset(Dataset):
    """One CIFAR-100 split as RGB PIL images through `transform`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable | None = None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = Image.fromarray(self.images[i], mode="RGB")
        return (self.transform(img) if self.transform else img), int(self.labels[i])


class Cifar100DataModule(ClassificationDataModule):
    """CIFAR-100 (50000 train / 10000 test images, used as validation), upsampled to `img_size` (224 in the paper)."""

    name = "cifar100"
    in_chans = 3
    num_classes = 100

    def __init__(self, *, root: str | Path | None = None, **kwargs):
        super().__init__(**kwargs)
        self.root = root
        self.classes: list[str] = []

    def prepare_data(self) -> None:
        find_cifar100(self.root)  # fail early, before any process spawns, with the help text

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        folder = find_cifar100(self.root)
        x_train, y_train, self.classes = read_cifar100_split(folder, "train")
        x_val, y_val, _ = read_cifar100_split(folder, "test")
        return (
            Cifar100Dataset(x_train, y_train, transform=self.train_transform()),
            Cifar100Dataset(x_val, y_val, transform=self.eval_transform()),
        )
