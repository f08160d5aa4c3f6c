"""The segmentation data (docs/dense.md): digit scenes are deterministic, leak nothing from training to validation and
label what they draw; segfolder reads image / label pairs and refuses what does not pair up; joint transforms keep
image and mask aligned."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ssogvit.data import DataError, DigitScenesDataModule, create_datamodule, load_digits_split
from ssogvit.data._segmentation import build_joint_transform
from ssogvit.errors import InputError


def scenes(**kw) -> DigitScenesDataModule:
    dm = create_datamodule("digit_scenes", **{"img_size": 64, "num_train_scenes": 6, "num_val_scenes": 4, **kw})
    dm.setup()
    return dm


def test_scenes_are_a_function_of_their_seed_and_index():
    a, b, other = scenes(), scenes(), scenes(scene_seed=1)
    for i in range(4):
        for x, y in zip(a.train_set[i], b.train_set[i]):
            assert torch.equal(x, y)
    assert not torch.equal(a.train_set[0][1], other.train_set[0][1])
    assert not torch.equal(a.train_set[0][1], a.val_set[0][1])  # the splits are not the same scenes


def test_training_and_validation_scenes_draw_from_disjoint_source_images():
    dm, split = scenes(), load_digits_split(0.2, 0, test_fraction=0)
    assert np.array_equal(dm.train_set.images, split["train"][0]) and np.array_equal(dm.val_set.images, split["val"][0])
    train = {im.tobytes() for im in dm.train_set.images}
    assert len(train) == len(dm.train_set.images) and not train & {im.tobytes() for im in dm.val_set.images}


def test_labels_are_background_or_the_digit_drawn_there():
    dm = scenes(img_size=128, digits_per_scene=1, scale=[0.5, 0.5], num_train_scenes=20)
    for i in range(20):
        x, y = dm.train_set[i]
        classes = set(y.unique().tolist())
        assert classes <= set(range(11)) and 0 in classes and len(classes) == 2  # one digit on the background
        ink = x[0][y > 0]  # (normalised to [-1, 1]) labelled pixels are brighter than the ink threshold 64/255
        assert float(ink.min()) > 2 * 64 / 255 - 1 - 1e-6 and float(x[0][y == 0].max()) <= 1.0


def test_the_same_scenes_come_back_at_another_canvas_size():
    small, large = scenes(img_size=64), scenes(img_size=256)
    for i in range(4):
        y_small, y_large = small.val_set[i][1], large.val_set[i][1]
        assert set(y_small.unique().tolist()) == set(y_large.unique().tolist())
        down = y_large[2::4, 2::4]  # nearest sample of the 256 px labels on the 64 px grid
        assert float((down == y_small).float().mean()) > 0.9


@pytest.mark.parametrize("kw, match", [
    (dict(scale=[0.3, 0.1]), "low is more than high"),
    (dict(scale=[0.1, 1.5]), "scale"),
    (dict(digits_per_scene=[4, 2]), "the fewest is more than the most"),
    (dict(img_size=32, scale=[0.05, 0.1]), "under 4 px"),
    (dict(num_val_scenes=0), "num_val_scenes"),
    (dict(ink=255), "ink"),
    (dict(aug={"scale": None, "mean": [0.5, 0.5], "std": [0.5]}), "in_chans=1"),
])
def test_bad_scene_options_are_refused_naming_them(kw, match):
    with pytest.raises((ValueError, InputError), match=match):
        scenes(**kw)


def _write_pair(root, split, name, size=(12, 10), *, label_size=None, value=1, suffix=".png"):
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), 200, np.uint8)).save(root / "images" / split / f"{name}{suffix}")
    w, h = label_size or size
    label = np.zeros((h, w), np.uint8)
    label[: h // 2] = value
    Image.fromarray(label, mode="L").save(root / "labels" / split / f"{name}.png")


def segfolder(root, **kw):
    return create_datamodule("segfolder", root=str(root), img_size=16, batch_size=2, num_classes=3,
                             aug={"mean": [0.5] * 3, "std": [0.5] * 3}, **kw)


def test_segfolder_reads_pairs_resized_with_their_labels(tmp_path):
    for split in ("train", "val"):
        _write_pair(tmp_path, split, "a")
        _write_pair(tmp_path, split, "b", suffix=".jpg", value=2)
    dm = segfolder(tmp_path)
    dm.prepare_data()
    dm.setup()
    x, y = dm.val_set[1]
    assert x.shape == (3, 16, 16) and y.shape == (16, 16) and y.dtype == torch.int64
    assert set(y.unique().tolist()) == {0, 2} and bool((y[:7] == 2).all()) and bool((y[9:] == 0).all())
    images, masks = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 16) and masks.shape == (2, 16, 16)


@pytest.mark.parametrize("case, match", [
    ("no label", "has no label"),
    ("no image", "has no image"),
    ("sizes", "a label must have its image's size"),
    ("no folder", "does not exist"),
])
def test_segfolder_refuses_what_does_not_pair_up(tmp_path, case, match):
    _write_pair(tmp_path, "val", "a")
    _write_pair(tmp_path, "train", "a", label_size=(5, 5) if case == "sizes" else None)
    if case == "no label":
        (tmp_path / "labels" / "train" / "a.png").unlink()
    if case == "no image":
        _write_pair(tmp_path, "train", "c")
        (tmp_path / "images" / "train" / "c.png").unlink()
    root = tmp_path / "missing" if case == "no folder" else tmp_path
    with pytest.raises(DataError, match=match):
        segfolder(root).prepare_data()


def test_segfolder_refuses_a_label_value_outside_the_classes_and_an_ignore_index_among_them(tmp_path):
    for split in ("train", "val"):
        _write_pair(tmp_path, split, "a", value=7)
    dm = segfolder(tmp_path)
    dm.setup()
    with pytest.raises(DataError, match="holds 7, neither a class"):
        dm.val_set[0]
    with pytest.raises(DataError, match="ignore_index=1 is one of the 3 classes"):
        segfolder(tmp_path, ignore_index=1)


def test_the_random_crop_moves_image_and_mask_together():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=(8, 8)).repeat(8, 0).repeat(8, 1)  # 8 px blocks of one class each
    image = Image.fromarray((labels * 60).astype(np.uint8), mode="L")
    transform = build_joint_transform(32, 1, {"scale": [0.3, 0.6], "mean": [0.0], "std": [1.0]}, is_training=True)
    torch.manual_seed(0)
    for _ in range(5):
        x, y = transform(image, labels)
        assert x.shape == (1, 32, 32) and y.shape == (32, 32)
        agree = torch.isclose(x[0] * 255 / 60, y.float(), atol=0.5).float().mean()
        assert float(agree) > 0.8  # bilinear image and nearest mask differ only along the block edges
