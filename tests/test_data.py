"""Each loader on small data written in its dataset's exact on-disk format."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from ssogvit.data import (
    Cifar100DataModule,
    DataError,
    ImageFolderDataModule,
    SyntheticDataset,
    create_datamodule,
    load_digits_split,
)

GRAY = {"mean": (0.5,), "std": (0.5,), "interpolation": "bilinear", "crop_pct": 1.0, "hflip": 0.0,
        "color_jitter": 0.0}


# digits ---------------------------------------------------------------------------------------------------------------
def test_digits_split_is_fixed_stratified_and_disjoint():
    a, b = load_digits_split(), load_digits_split()
    sizes = {k: len(a[k][1]) for k in ("train", "val", "test")}
    assert sizes == {"train": 1259, "val": 269, "test": 269} and sum(sizes.values()) == 1797
    for k in ("val", "test"):
        assert np.array_equal(a[k][1], b[k][1]) and np.array_equal(a[k][0], b[k][0])
        assert set(np.unique(a[k][1])) == set(range(10))
        counts = np.bincount(a[k][1], minlength=10) / np.bincount(np.concatenate([a[s][1] for s in sizes]))
        assert np.all(np.abs(counts - 0.15) < 0.02)  # each class 15% in validation and 15% in test
    rows = {k: [x.tobytes() + bytes([y]) for x, y in zip(*a[k])] for k in sizes}
    for k, other in (("val", "train"), ("test", "train"), ("test", "val")):
        held = set(rows[other])
        assert sum(r in held for r in rows[k]) < 5  # sklearn's digits holds a few exact duplicates, no more
    assert a["train"][0].dtype == np.uint8 and a["train"][0].max() == 255
    # the test images do not depend on the validation fraction; test_fraction=0 is the older train / val split
    assert np.array_equal(load_digits_split(val_fraction=0.3)["test"][0], a["test"][0])
    two = load_digits_split(0.2, test_fraction=0)
    assert "test" not in two and len(two["train"][1]) + len(two["val"][1]) == 1797


def test_digits_datamodule_upsamples_and_normalises():
    dm = create_datamodule("digits", img_size=32, batch_size=8, aug=GRAY, num_classes=10, in_chans=1)
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (8, 1, 32, 32) and x.dtype == torch.float32
    assert -1.0 - 1e-6 <= float(x.min()) and float(x.max()) <= 1.0 + 1e-6
    assert y.dtype == torch.int64 and int(y.max()) < 10
    xt, _ = next(iter(dm.train_dataloader()))
    assert xt.shape == (8, 1, 32, 32)


@pytest.mark.parametrize("jitter", [0.0, 0, (0.0, 0.0, 0.0), [0, 0, 0, 0]])
def test_a_zero_color_jitter_adds_no_transform(jitter):
    """timm adds a ColorJitter for a jitter of 0 that changes nothing and costs half of a small image's pipeline."""
    from omegaconf import OmegaConf
    from torchvision.transforms import ColorJitter

    from ssogvit.data._common import build_transform

    for aug in ({**GRAY, "color_jitter": jitter}, OmegaConf.create({**GRAY, "color_jitter": jitter})):
        names = [type(t) for t in build_transform(8, 1, aug, is_training=True).transforms]
        assert ColorJitter not in names and len(names) == 3  # crop, to tensor, normalise
    kept = build_transform(8, 1, {**GRAY, "color_jitter": 0.2}, is_training=True).transforms
    assert any(isinstance(t, ColorJitter) for t in kept)


def test_digits_rejects_a_wrong_class_count():
    with pytest.raises(ValueError, match="num_classes"):
        create_datamodule("digits", img_size=32, num_classes=100)


def test_unknown_dataset_and_aug_option_are_errors():
    with pytest.raises(ValueError, match="unknown dataset"):
        create_datamodule("mnist", img_size=32)
    dm = create_datamodule("digits", img_size=32, aug={"flip_everything": 1.0})
    with pytest.raises(ValueError, match="unknown aug options"):
        dm.setup()


# cifar100 -------------------------------------------------------------------------------------------------------------
def _write_cifar100(root, n_train=12, n_test=6, seed=0):
    """A miniature cifar-100-python folder: the same three pickles, keys and layouts as the real archive."""
    rng = np.random.RandomState(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    splits = {}
    for split, n in (("train", n_train), ("test", n_test)):
        data = rng.randint(0, 256, size=(n, 3072)).astype(np.uint8)
        fine = rng.randint(0, 100, size=n).tolist()
        batch = {b"filenames": [f"img_{i}.png".encode() for i in range(n)], b"batch_label": split.encode(),
                 b"fine_labels": fine, b"coarse_labels": [f // 5 for f in fine], b"data": data}
        with open(folder / split, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        splits[split] = (data, fine)
    meta = {b"fine_label_names": [f"class{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"super{i}".encode() for i in range(20)]}
    with open(folder / "meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return splits


def test_cifar100_reads_the_python_folder(tmp_path):
    splits = _write_cifar100(tmp_path)
    dm = Cifar100DataModule(root=tmp_path, img_size=32, batch_size=4, aug={"crop_pct": 1.0, "interpolation": "bilinear"})
    dm.prepare_data()
    dm.setup()
    assert len(dm.train_set) == 12 and len(dm.val_set) == 6 and dm.classes[7] == "class7"
    img, label = dm.val_set.images[2], dm.val_set.labels[2]
    data, fine = splits["test"]
    # the file stores each image channel-major: 1024 red, 1024 green, 1024 blue values, rows of 32
    assert img.shape == (32, 32, 3) and label == fine[2]
    assert img[5, 7, 0] == data[2, 5 * 32 + 7] and img[5, 7, 2] == data[2, 2048 + 5 * 32 + 7]
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.tolist() == fine[:4]
    # data.root may also name the cifar-100-python folder itself
    dm2 = Cifar100DataModule(root=tmp_path / "cifar-100-python", img_size=32)
    dm2.setup()
    assert len(dm2.train_set) == 12


def test_cifar100_missing_folder_says_where_to_get_it(tmp_path):
    dm = Cifar100DataModule(root=tmp_path / "nowhere", img_size=32)
    with pytest.raises(DataError) as err:
        dm.prepare_data()
    msg = str(err.value)
    assert "cifar-100-python.tar.gz" in msg and "https://www.cs.toronto.edu/~kriz/" in msg
    assert str(tmp_path / "nowhere") in msg and "data.root" in msg


def test_cifar100_malformed_file_is_a_clear_error(tmp_path):
    _write_cifar100(tmp_path)
    (tmp_path / "cifar-100-python" / "train").write_bytes(b"not a pickle at all")
    dm = Cifar100DataModule(root=tmp_path, img_size=32)
    with pytest.raises(DataError, match="not a CIFAR-100 python pickle"):
        dm.setup()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_cifar100_pickle_cannot_run_code(tmp_path):
    _write_cifar100(tmp_path)
    with open(tmp_path / "cifar-100-python" / "test", "wb") as f:
        pickle.dump({b"data": _Evil(), b"fine_labels": [0]}, f, protocol=2)
    dm = Cifar100DataModule(root=tmp_path, img_size=32)
    with pytest.raises(DataError, match="refusing to load global"):
        dm.setup()


# imagefolder ----------------------------------------------------------------------------------------------------------
def _write_imagefolder(root, classes=("cat", "dog", "eel"), per_class=3):
    rng = np.random.RandomState(0)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                arr = rng.randint(0, 256, size=(20, 24, 3)).astype(np.uint8)
                Image.fromarray(arr).save(root / split / c / f"{i}.JPEG", format="JPEG")


def test_imagefolder_reads_train_and_val(tmp_path):
    _write_imagefolder(tmp_path)
    dm = create_datamodule("imagefolder", root=str(tmp_path), img_size=16, batch_size=4, num_classes=None,
                           aug={"crop_pct": 1.0})
    assert dm.num_classes == 3
    dm.setup()
    assert dm.classes == ["cat", "dog", "eel"] and len(dm.train_set) == 9 and len(dm.val_set) == 9
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 16, 16) and y.tolist() == [0, 0, 0, 1]
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 16, 16)


def test_imagefolder_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        create_datamodule("imagefolder", root=str(tmp_path), img_size=16)
    _write_imagefolder(tmp_path)
    (tmp_path / "val" / "extra").mkdir()
    with pytest.raises(DataError, match="class folders differ"):
        create_datamodule("imagefolder", root=str(tmp_path), img_size=16)


# synthetic ------------------------------------------------------------------------------------------------------------
def test_synthetic_is_a_pure_function_of_seed_and_index():
    a = SyntheticDataset(10, img_size=8, in_chans=3, num_classes=5, seed=3)
    b = SyntheticDataset(10, img_size=8, in_chans=3, num_classes=5, seed=3)
    c = SyntheticDataset(10, img_size=8, in_chans=3, num_classes=5, seed=4)
    assert torch.equal(a[7][0], b[7][0]) and a[7][1] == b[7][1]
    assert not torch.equal(a[7][0], c[7][0])
    assert a[0][0].shape == (3, 8, 8) and 0 <= a[0][1] < 5
    with pytest.raises(IndexError):
        a[10]
    dm = create_datamodule("synthetic", img_size=8, batch_size=4, train_size=8, val_size=4, num_classes=5)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 8, 8) and dm.num_classes == 5
