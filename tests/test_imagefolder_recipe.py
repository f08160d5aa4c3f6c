"""`experiment=imagefolder_small`: a folder of one's own images trains out of the box with a small-data recipe, and
on the digits written out as image files it learns as the digits datamodule does from the same images."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

import cli_process

from ssogvit.data.digits import load_digits_split

GRAYSCALE = ["data.in_chans=1", "data.aug.mean=[0.5]", "data.aug.std=[0.5]", "data.aug.hflip=0.0"]


def write_digits_folder(root: Path) -> Path:
    """The digits' fixed split as PNG files, `root/{train,val}/<digit>/<index>.png` (8x8 grayscale, as embedded)."""
    for split, (images, labels) in load_digits_split().items():
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, mode="L").save(folder / f"{i:04d}.png")
    return root


def test_the_recipe_is_small_data_not_deit():
    from ssogvit.train.config import compose

    cfg = compose(["experiment=imagefolder_small", "data.root=/nowhere"])
    deit = compose(["data=imagefolder", "data.root=/nowhere"])
    assert deit.data.aug.auto_augment and deit.mixup.mixup_alpha > 0 and deit.data.num_workers == 10  # what it replaces
    assert cfg.data.aug.auto_augment is None and cfg.data.aug.re_prob == 0
    assert cfg.mixup.mixup_alpha == 0 and cfg.mixup.cutmix_alpha == 0
    assert (cfg.data.batch_size, cfg.optim.lr_base_batch, cfg.data.num_workers) == (32, 32, 2)
    assert cfg.data.img_size // cfg.model.kwargs.patch_size == 8 and cfg.model.kwargs.global_pool == "avg"


def test_a_folder_of_real_images_trains_through_the_command_line(tmp_path):
    root = write_digits_folder(tmp_path / "digits")
    out = tmp_path / "run"
    res = cli_process.run(
        ["train", "experiment=imagefolder_small", f"data.root={root}", *GRAYSCALE, "trainer.max_epochs=1",
         "trainer.limit_train_batches=4", "trainer.limit_val_batches=2", f"output_dir={out}", "progress.mode=none",
         "data.num_workers=0"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    from ssogvit.train.io import load_model

    model = load_model(out / "export" / "model.safetensors")
    assert model.num_classes == 10 and model.config["name"] == "vit-tiny-ssog" and model.config["in_chans"] == 1
    assert OmegaConf.load(out / "config.yaml").data.root == str(root) and "val   top-1" in res.stdout


def test_without_a_root_the_recipe_says_what_to_pass(tmp_path):
    res = cli_process.run(["train", "experiment=imagefolder_small", f"output_dir={tmp_path / 'run'}"], timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "data.root" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2 and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two 30-epoch runs: about 3 minutes on a quiet 2-core machine
def test_on_the_digits_as_files_it_reaches_what_the_digits_datamodule_reaches(tmp_path):
    """Same images, same recipe and model, one loaded from PNG files by `imagefolder`, one from scikit-learn."""
    from ssogvit.train.config import compose
    from ssogvit.train.run import train

    root = write_digits_folder(tmp_path / "digits")
    common = [*GRAYSCALE, "trainer.accelerator=cpu", "progress.mode=none", "resume=null", "data.num_workers=0"]
    folder_cfg = compose(["experiment=imagefolder_small", f"data.root={root}", *common,
                          f"output_dir={tmp_path / 'folder'}"])
    digits_cfg = compose(["experiment=imagefolder_small", f"data.root={root}", *common,
                          f"output_dir={tmp_path / 'sklearn'}"])
    digits_cfg.data.name, digits_cfg.data.root, digits_cfg.data.num_classes = "digits", None, 10
    folder = train(folder_cfg, verbose=False)["metrics"]["val/top1"]
    digits = train(digits_cfg, verbose=False)["metrics"]["val/top1"]
    print(f"imagefolder {folder:.2f}%, digits {digits:.2f}%")
    assert digits > 85 and abs(folder - digits) < 5
