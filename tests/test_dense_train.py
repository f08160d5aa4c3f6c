"""Segmentation through the real command line (docs/dense.md): `ssogvit train` on digit scenes writes the run folder
of every run with mIoU and pixel accuracy in its log, `ssogvit eval` scores it at another canvas size with and
without `--rescale-field`, a run resumes from its checkpoint, and what does not fit is refused in one line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli_process

from ssogvit.cli import main as cli_main
from ssogvit.layers import list_mixers
from ssogvit.train.config import compose, list_experiments

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
MIXERS = {"mha": "mha", "ssog": "ssog", "ssog_steered": "ssog-steered", "window": "window",
          "neighborhood": "neighborhood", "linear": "linear"}


def tiny_scenes(out: Path, *extra: str) -> list[str]:
    """A seconds-long segmentation run: the comparison's experiment at 64 px, a 1-block backbone, 4 steps."""
    return [
        "experiment=scenes_vit_ssog", "data.img_size=64", "data.num_train_scenes=8", "data.num_val_scenes=4",
        "data.batch_size=2", "data.eval_batch_size=4", "model.kwargs.depth=1", "model.kwargs.embed_dim=16",
        "model.kwargs.num_heads=2", "model.kwargs.pyramid_dim=8", "model.kwargs.head_dim=8",
        "trainer.limit_train_batches=null", "trainer.accelerator=cpu", "trainer.devices=1",
        "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "logger=[csv]", f"output_dir={out}",
        *extra,
    ]


def cli(*args: str) -> subprocess.CompletedProcess:
    return cli_process.run(list(args), env=ENV, timeout=300)


def logged(run: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((run / "logs").glob("version_*/metrics.csv")):
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f) if r.get("val/miou")]
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scenes") / "run"
    proc = cli("train", *tiny_scenes(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mIoU" in proc.stdout and "pixel accuracy" in proc.stdout
    return out


def test_a_scenes_run_writes_its_folder_with_miou_and_pixel_accuracy(trained):
    assert json.loads((trained / "run.json").read_text())["status"] == "finished"
    for name in ("config.yaml", "checkpoints/last.ckpt", "checkpoints/best.ckpt", "export/model.safetensors"):
        assert (trained / name).is_file(), name
    meta = json.loads((trained / "export" / "model.json").read_text())
    assert meta["model_config"]["task"] == "segmentation" and meta["model_config"]["num_classes"] == 11
    (row,) = logged(trained)
    assert 0.0 <= float(row["val/miou"]) <= 100.0 and 0.0 <= float(row["val/pixel_acc"]) <= 100.0
    assert float(row["val/miou"]) == pytest.approx(meta["metrics"]["val/miou"])


def test_eval_scores_the_run_at_another_size_with_and_without_rescale_field(trained, tmp_path):
    results = {}
    for flags in ([], ["--img-size", "128"], ["--img-size", "128", "--rescale-field"]):
        path = tmp_path / f"r{len(flags)}.json"
        code = cli_main(["eval", "--ckpt", str(trained / "checkpoints" / "best.ckpt"), *flags, "--json", str(path),
                         "--progress", "none"])
        assert code == 0
        results[len(flags)] = json.loads(path.read_text())
    same = results[0]
    (row,) = logged(trained)
    assert same["img_size"] == 64 and same["miou"] == pytest.approx(float(row["val/miou"]), abs=1e-3)
    assert results[2]["img_size"] == results[3]["img_size"] == 128 and results[3]["rescale_field"]
    assert results[2]["images"] == 4 and 0 <= results[2]["miou"] <= 100 and 0 <= results[2]["pixel_acc"] <= 100
    assert results[2]["loss"] != results[3]["loss"]  # the fixed field was scaled by the grid ratio, 2


@pytest.mark.slow
def test_a_run_resumes_from_its_epoch_end_checkpoint(trained, tmp_path):
    out = tmp_path / "longer"
    proc = cli("train", *tiny_scenes(out, "trainer.max_epochs=2", f"resume={trained / 'checkpoints' / 'last.ckpt'}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    assert [int(r["epoch"]) for r in logged(out)] == [1]  # the first epoch came from the checkpoint
    again = cli("train", *tiny_scenes(trained))
    assert again.returncode == 2 and "finished" in again.stderr.splitlines()[-1]


@pytest.mark.parametrize("extra, needle", [
    (["data.img_size=72"], "patch_size 16 does not divide img_size (72, 72)"),
    (["model.kwargs.task=null"], "set model.kwargs.task=segmentation"),
    (["ckpt.monitor=val/top1"], "use val/miou"),
    (["data.scale=[0.3,0.1]"], "low is more than high"),
    (["mixup.mixup_alpha=0.8"], "mixup"),
])
def test_what_does_not_fit_is_refused_in_one_line(tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert cli_main(["train", *tiny_scenes(out, *extra)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssogvit train: ") and needle in err[-1] and "Traceback" not in "\n".join(err)
    assert not out.exists()


def test_eval_refuses_a_canvas_the_patch_does_not_divide(trained, capsys):
    assert cli_main(["eval", "--ckpt", str(trained / "export" / "model.safetensors"), "--img-size", "100"]) == 2
    assert "not a multiple of the patch size 16" in capsys.readouterr().err


@pytest.mark.parametrize("experiment", [e for e in list_experiments() if e.startswith("scenes_vit_")])
def test_the_comparison_differs_only_in_the_mixer(experiment):
    mixer = MIXERS[experiment.removeprefix("scenes_vit_")]
    if mixer not in list_mixers():
        pytest.skip(f"mixer {mixer!r} is not registered in this checkout")
    cfg, ref = compose([f"experiment={experiment}"]), compose(["experiment=scenes_vit_ssog"])
    assert cfg.model.mixer == mixer and cfg.data.img_size == 512 and cfg.model.kwargs.task == "segmentation"
    for section in ("data", "trainer", "optim", "sched", "loss"):
        assert cfg[section] == ref[section], section
    assert {k: v for k, v in cfg.model.kwargs.items()} == {k: v for k, v in ref.model.kwargs.items()}


def test_report_tables_the_miou_of_segmentation_runs(trained, tmp_path):
    assert cli_main(["report", str(trained), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "segmentation.md").read_text()
    (row,) = logged(trained)
    assert f"| scenes_vit_ssog | ssog | {float(row['val/miou']):.2f} (1 seed) |" in text
    assert (tmp_path / "report" / "curves.png").is_file() and (tmp_path / "report" / "segmentation.png").is_file()
    assert not (tmp_path / "report" / "runs.md").exists()


def test_a_transfer_of_a_segmentation_model_to_classification_data_says_the_task_is_the_sources(trained, tmp_path):
    """The fifth audit's E223: the refusal advised `model.kwargs.task=null`, which a transfer (the source's
    architecture) cannot take; it says what a transfer keeps instead, before anything is written."""
    out = tmp_path / "t"
    proc = cli("transfer", "--ckpt", str(trained / "export" / "model.safetensors"), "--mode", "finetune",
               "data=digits", f"output_dir={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "a transfer keeps its source's task: transfer it to segmentation data" in proc.stderr
    assert not out.exists()
