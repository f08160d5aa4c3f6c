"""The command line as users meet it: each test runs the console script's entry function in a child process
(tests/cli_process.py: forked from a server that has done the imports) and checks the exit status and the first line
of what it says; the tests about the process itself start `python -m ssogvit` with subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cli_process

import cli_process

# a seconds-long run: a 2-block width-32 ViT on 64 synthetic 16 px images (two blocks: the class token of one block
# is a plain mean of the patches, which does not see the SSoG field)
TINY_MODEL = ["model=vit", "model.size=tiny", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2",
              "model.kwargs.depth=2", "model.kwargs.patch_size=4", "model.kwargs.drop_path_rate=0.0",
              "trainer.max_epochs=1", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.log_every_n_steps=1",
              "ckpt.every_n_train_steps=null"]
TINY = ["data=synthetic", "data.img_size=16", "data.train_size=64", "data.val_size=32", "data.batch_size=16",
        "data.learnable=true", *TINY_MODEL]
# the same on the embedded digits, two steps of one epoch
DIGITS = ["experiment=digits_vit_ssog", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
          "trainer.limit_val_batches=1", "trainer.accelerator=cpu", "data.num_workers=0"]


def ssogvit(*args: str, cwd: Path | None = None, timeout: float = 300, fresh: bool = False,
            **env: str) -> subprocess.CompletedProcess:
    """`ssogvit args...` in a child process (tests/cli_process.py) with this environment, one torch thread;
    `fresh`: in a fresh interpreter (`python -m ssogvit`), for what depends on the process (worker processes)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    full_env.pop("SSOGVIT_DEBUG", None) if "SSOGVIT_DEBUG" not in env else None
    if not fresh:
        return cli_process.run(list(args), cwd=cwd, env=full_env, timeout=timeout)
    res = subprocess.run([sys.executable, "-m", "ssogvit", *args], cwd=cwd, env=full_env, capture_output=True,
                         timeout=timeout)
    # decoded by hand: text mode would turn the `\r` of a progress bar into `\n`
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(errors="replace"),
                                       res.stderr.decode(errors="replace"))


def first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")


def assert_user_error(res: subprocess.CompletedProcess, starts: str, *, mid_run: bool = False) -> None:
    """Exit status 2, a message of at most two lines that starts with `starts`, and no traceback.

    `mid_run`: the error came after Lightning started (which logs to stderr): the message is the last line.
    """
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    message = lines[-1] if mid_run else first_line(res.stderr)
    assert message.startswith(starts), res.stderr[-3000:]
    assert "Traceback" not in res.stderr and (mid_run or len(lines) <= 2), res.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    res = ssogvit("train", *TINY, f"output_dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


# -- the console script -------------------------------------------------------------------------------------------

def test_version_and_unknown_command():
    from ssogvit import __version__

    res = ssogvit("--version")
    assert res.returncode == 0 and first_line(res.stdout) == f"ssogvit {__version__}"
    res = ssogvit("trian")
    assert_user_error(res, "ssogvit: unknown command 'trian'")


def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "ssogvit", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ})
    proc.stdout.close()  # the reader goes away before the first line is written (as `| head` does, at its pace)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


@pytest.mark.parametrize("how", ["--debug", pytest.param("SSOGVIT_DEBUG=1", marks=pytest.mark.slow)])
def test_debug_flag_and_environment_variable_show_the_traceback(how):
    # the same mistake without them: one line (test_train_mistakes_end_in_one_or_two_lines)
    res = ssogvit("train", "experiment=nope", "--debug") if how == "--debug" else \
        ssogvit("train", "experiment=nope", SSOGVIT_DEBUG="1")
    assert res.returncode != 0 and "Traceback (most recent call last)" in res.stderr
    assert "MissingConfigException" in res.stderr


# -- Hydra's command line -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, starts", [
    (["experiment=nope"], "ssogvit train: In 'config': Could not find 'experiment/nope'; options: "),
    pytest.param(["experiment=cifar100_vit_bse_ssog"],
     "ssogvit train: In 'config': Could not find 'experiment/cifar100_vit_bse_ssog'; did you mean "
     "cifar100_vit_base_ssog", marks=pytest.mark.slow),
    (["data.root=/x"], "ssogvit train: the data cannot be set up from this config: data=digits has no option root "
                       "(the digits are embedded in scikit-learn"),
    pytest.param(["data.rot=/x"], "ssogvit train: Could not override 'data.rot'. To append to your config use "
                                  "+data.rot=/x", marks=pytest.mark.slow),
    pytest.param(["model.mixer=ssog,mha"], "ssogvit train: Ambiguous value for argument 'model.mixer=ssog,mha'",
                 marks=pytest.mark.slow),
    pytest.param(["-m", "model.mixer=ssog,mha", "--cfg", "job"], "ssogvit train: Only one of --run, --multirun, --cfg",
                 marks=pytest.mark.slow),
    pytest.param(["+trainer.logger=false"], "ssogvit train: Could not append to config. An item is already at "
                                            "'trainer.logger'", marks=pytest.mark.slow),
    pytest.param(["--bogus"], "ssogvit train: unknown option --bogus; options are Hydra's and overrides are key=value",
                 marks=pytest.mark.slow),
])
def test_train_mistakes_end_in_one_or_two_lines(tmp_path, args, starts):
    res = ssogvit("train", *args, f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_user_error(res, starts)
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()  # nothing written


def test_help_and_cfg_job():
    res = ssogvit("train", "--help")
    assert res.returncode == 0 and first_line(res.stdout).startswith("usage: ssogvit train [-m]")
    assert "experiment: " in res.stdout and "logger: csv, mlflow, tensorboard, wandb" in res.stdout
    res = ssogvit("train", "experiment=digits_vit_mha", "--cfg", "job", "--resolve")
    assert res.returncode == 0
    cfg = yaml.safe_load(res.stdout)
    assert first_line(res.stdout) == "name: digits_vit_mha" and cfg["output_dir"] == "runs/digits_vit_mha"
    assert cfg["model"]["mixer"] == "mha" and "hydra" not in cfg and set(cfg["logger"]) == {"csv", "tensorboard"}


@pytest.mark.slow
def test_multirun_sweep_gives_each_job_its_own_folder_and_keeps_the_folder_rules(tmp_path):
    sweep = tmp_path / "sweep"
    res = ssogvit("train", "-m", *TINY, "model.mixer=ssog,mha", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    mixers = {}
    for job in ("0", "1"):
        cfg = yaml.safe_load((sweep / job / "config.yaml").read_text())
        assert cfg["output_dir"] == str(sweep / job)
        assert json.loads((sweep / job / "run.json").read_text())["status"] == "finished"
        assert (sweep / job / "export" / "model.safetensors").is_file()
        mixers[job] = cfg["model"]["mixer"]
    assert mixers == {"0": "ssog", "1": "mha"}
    assert not (tmp_path / "runs").exists()  # Hydra wrote nothing outside the sweep folder
    # a sweep into one folder: the first job's finished run is never overwritten, each job is refused in one line
    res = ssogvit("train", "-m", *TINY, "model.mixer=ssog,mha", f"output_dir={sweep / '0'}",
                  f"hydra.sweep.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert_user_error(res, "ssogvit train: 2 job(s) of the sweep failed", mid_run=True)  # after Lightning's lines
    assert f"job #0, #1: {sweep / '0'} holds a finished run" in res.stderr


@pytest.mark.slow
def test_submitit_local_launcher_runs_each_job_in_its_own_process(tmp_path):
    sweep = tmp_path / "sweep"
    res = ssogvit("train", "-m", "hydra/launcher=submitit_local", *DIGITS, "model.mixer=ssog,mha",
                  f"hydra.sweep.dir={sweep}", "trainer.enable_progress_bar=false", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for job, mixer in (("0", "ssog"), ("1", "mha")):
        assert json.loads((sweep / job / "run.json").read_text())["status"] == "finished"
        assert yaml.safe_load((sweep / job / "config.yaml").read_text())["model"]["mixer"] == mixer
    logs = sorted(p.name for p in (sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2  # one submitit job (a local process) per sweep point


def test_submitit_slurm_launcher_asks_for_what_the_config_needs():
    res = ssogvit("train", "hydra/launcher=submitit_slurm", "experiment=cifar100_vit_base_ssog", "trainer.num_nodes=2",
                  "cluster.gpus_per_node=4", "cluster.timeout_min=600", "cluster.partition=gpu", "--cfg", "all",
                  "--resolve")
    assert res.returncode == 0 and res.stderr == "", res.stderr[-3000:]
    launcher = yaml.safe_load(res.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["nodes"], launcher["gpus_per_node"], launcher["tasks_per_node"]) == (2, 4, 4)
    assert (launcher["timeout_min"], launcher["partition"], launcher["name"]) == (600, "gpu", "cifar100_vit_base_ssog")


# -- loggers, callbacks, progress ---------------------------------------------------------------------------------

@pytest.mark.parametrize("package", ["wandb", pytest.param("mlflow", marks=pytest.mark.slow)])
def test_a_logger_whose_package_is_missing_is_named_before_anything_is_written(tmp_path, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    res = ssogvit("train", *TINY, f"logger=[csv,{package}]", f"output_dir={tmp_path / 'run'}")
    assert_user_error(res, f"ssogvit train: logger={package} needs a package that is not installed: "
                           f"Requirement '{package}")
    assert not (tmp_path / "run").exists()


def test_loggers_callbacks_and_plain_progress_lines(tmp_path):
    out = tmp_path / "run"
    res = ssogvit("train", *TINY, "trainer.max_epochs=2", "logger=[csv]", "callbacks=[early_stopping]",
                  "progress.every_n_steps=2", "trainer.check_val_every_n_epoch=2", f"output_dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "logs").is_dir() and not (out / "tb").exists()
    assert yaml.safe_load((out / "config.yaml").read_text())["callbacks"]["early_stopping"]["monitor"] == "val/top1"
    lines = [line for line in res.stdout.splitlines() if line.startswith("epoch ")]
    # 4 steps an epoch: a line at steps 2 and 4, then the epoch's line, twice
    assert [" ".join(line.split()[:4]) for line in lines] == [
        "epoch 1/2 step 2", "epoch 1/2 step 4", "epoch 1/2 step 4", "epoch 2/2 step 6", "epoch 2/2 step 8",
        "epoch 2/2 step 8"]
    assert lines[0].startswith("epoch 1/2  step 2  batch 2/4  loss ")
    assert "train/top1 " in lines[2] and "val/" not in lines[2]  # no validation in epoch 1: none shown
    assert "val/top1 " in lines[5] and "val/top1" not in lines[3]
    assert "\r" not in res.stdout + res.stderr  # no terminal: no progress-bar frames


@pytest.mark.slow
def test_no_logger_at_all_and_a_forced_bar(tmp_path):
    # the bar forced on even without a terminal draws its frames (the check above can fail)
    res = ssogvit("train", *TINY, "trainer.logger=false", "progress.mode=bar", f"output_dir={tmp_path / 'bare'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "bare" / "logs").exists() and not (tmp_path / "bare" / "tb").exists()
    assert "\r" in res.stdout + res.stderr


@pytest.mark.slow
def test_main_prints_where_it_drew_the_curves(tmp_path):
    res = ssogvit("main", "--out", str(tmp_path / "main"), "--epochs", "1", "--mixers", "ssog",
                  "trainer.limit_train_batches=2", "trainer.limit_val_batches=1")
    assert res.returncode == 1, res.stderr[-3000:]  # two steps do not reach 90%
    assert f"training curves: {tmp_path / 'main' / 'curves.png'}" in res.stdout
    assert (tmp_path / "main" / "curves.png").read_bytes()[:4] == b"\x89PNG"


# -- eval ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, starts", [
    (["--img-size", "18"],
     "ssogvit eval: image size 18 is not a multiple of the patch size 4; use --img-size 16 or 20"),
    pytest.param(["--bogus", "1"], "ssogvit eval: unknown argument '--bogus'", marks=pytest.mark.slow),
    pytest.param(["--patch-size", "3"], "ssogvit eval: image size 16 is not a multiple of the patch size 3",
                 marks=pytest.mark.slow),
    pytest.param(["--rescale-field"], "ssogvit eval: --rescale-field rescales the field to another grid",
                 marks=pytest.mark.slow),
    pytest.param(["--img-size", "0"], "ssogvit eval: argument --img-size: expected a positive integer, got 0",
                 marks=pytest.mark.slow),
    pytest.param(["model.depth=2"], "ssogvit eval: unknown argument 'model.depth=2'", marks=pytest.mark.slow),
])
def test_eval_mistakes_end_in_one_or_two_lines(tiny_run, args, starts):
    assert_user_error(ssogvit("eval", "--ckpt", str(tiny_run / "checkpoints" / "best.ckpt"), *args), starts)


@pytest.fixture
def lone_export(tmp_path) -> Path:
    """An export carried away from its run folder: `model.safetensors` and its `model.json` (data: synthetic)."""
    from ssogvit.models import create_model
    from ssogvit.train.io import export_safetensors

    model = create_model("vit-tiny-ssog", img_size=16, patch_size=4, embed_dim=32, num_heads=2, depth=1,
                         num_classes=10)
    data = {"name": "synthetic", "root": None, "num_classes": 10, "in_chans": 3, "img_size": 16, "batch_size": 16,
            "eval_batch_size": 32, "num_workers": 0, "train_size": 64, "val_size": 32, "seed": 0, "learnable": True}
    return export_safetensors(model, tmp_path / "lone" / "model.safetensors", extra={"data": data})


def test_eval_takes_an_exports_data_settings_from_its_seal_and_refuses_an_edited_copy(lone_export):
    """The audit's B56: the data part of an export's model.json is sealed with the weights; an edit of it is named,
    not obeyed."""
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "--progress", "none")
    assert res.returncode == 0 and " at 16 px" in res.stdout, res.stderr[-3000:]
    side = lone_export.with_suffix(".json")
    side.write_text(side.read_text().replace('"img_size": 16,', '"img_size": 32,'))
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "--progress", "none")
    assert_user_error(res, f"ssogvit eval: {side} does not match the config sealed in {lone_export} "
                           "(data.img_size: 32 in model.json, 16 in the weights)")


def test_eval_refuses_data_options_that_split_the_images_otherwise_than_the_run(lone_export):
    """The audit's B57: a validation split drawn otherwise than the run's may hold images it trained on (synthetic:
    the validation images of seed 1 are the training images of seed 0); the options that decide a split are declared
    by each datamodule (`split_options`)."""
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "data.seed=1")
    assert_user_error(res, "ssogvit eval: data.seed=1: the checkpoint's run was trained with data.seed=0")


def test_eval_takes_a_checkpoints_data_settings_from_it_and_refuses_an_edited_config_yaml(tiny_run, tmp_path):
    """The audit's C041: a checkpoint records its run's data settings under its digest; the run's config.yaml edited
    since (another split: training images scored as validation) is named, not obeyed."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpt = run / "checkpoints" / "last.ckpt"
    res = ssogvit("eval", "--ckpt", str(ckpt), "--device", "cpu", "--progress", "none")
    assert res.returncode == 0 and " at 16 px" in res.stdout, res.stderr[-3000:]
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["seed"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    res = ssogvit("eval", "--ckpt", str(ckpt), "--device", "cpu", "--progress", "none")
    assert_user_error(res, f"ssogvit eval: {run / 'config.yaml'} was changed since {ckpt} was written "
                           "(data.seed: last.ckpt 0, config.yaml 1)")


def test_eval_reads_an_exports_data_from_its_seal_when_the_copy_beside_it_is_gone(lone_export):
    """The fifth audit's E020-E023: the data settings sealed in an export's header hold whether or not its readable
    copy (model.json) is beside it; without it the split is still the run's, and an option that splits otherwise is
    still refused."""
    side = lone_export.with_suffix(".json")
    side.unlink()
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "--progress", "none")
    assert res.returncode == 0 and " at 16 px" in res.stdout, res.stderr[-3000:]
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "data.seed=1")
    assert_user_error(res, "ssogvit eval: data.seed=1: the checkpoint's run was trained with data.seed=0")
    side.mkdir()  # a copy that is not a file is no copy: the seal still holds
    res = ssogvit("eval", "--ckpt", str(lone_export), "--device", "cpu", "--progress", "none")
    assert res.returncode == 0 and " at 16 px" in res.stdout, res.stderr[-3000:]


def test_eval_refuses_a_run_config_yaml_that_describes_another_model(tiny_run, tmp_path):
    """The fifth audit's E034: the run's config.yaml is a readable copy of what the checkpoint and the export record;
    its model edited since (another depth) is named like its data, for either file."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    depth = config["model"]["kwargs"]["depth"]
    config["model"]["kwargs"]["depth"] = depth + 2
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    for file in (run / "checkpoints" / "last.ckpt", run / "export" / "model.safetensors"):
        res = ssogvit("eval", "--ckpt", str(file), "--device", "cpu", "--progress", "none")
        assert_user_error(res, f"ssogvit eval: {run / 'config.yaml'} was changed since {file} was written "
                               f"(model.depth: {file.name} {depth}, config.yaml {depth + 2})")


@pytest.mark.slow
def test_eval_applies_rescale_field_with_img_size_and_prints_lines(tiny_run, tmp_path):
    results = {}
    for rescale in ([], ["--rescale-field"]):
        out = tmp_path / f"eval{len(rescale)}.json"
        res = ssogvit("eval", "--ckpt", str(tiny_run / "export" / "model.safetensors"), "--img-size", "32",
                      "--device", "cpu", "--json", str(out), *rescale)
        assert res.returncode == 0, res.stderr[-3000:]
        assert first_line(res.stdout).startswith("eval: batch 1/1, 32 images, top-1 so far")
        assert "\r" not in res.stdout + res.stderr
        results[bool(rescale)] = json.loads(out.read_text())
    assert results[True]["rescale_field"] and not results[False]["rescale_field"]
    assert results[True]["img_size"] == results[False]["img_size"] == 32
    assert results[True]["loss"] != results[False]["loss"]  # the field was rescaled (grid 4x4 -> 8x8)


def test_no_command_writes_a_file_into_a_run_folder(tiny_run, tmp_path):
    """The fifth audit's E062-E065: a run folder holds its run's files only; `eval --json` and `export --out` inside
    one are refused like `--out` folders are, new file or existing one, with `--overwrite` or not (a run's
    model.json, metrics.csv and checkpoints were replaced by an eval's JSON), and nothing there changes."""
    import hashlib
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)

    def digests():
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}

    before, ckpt = digests(), run / "checkpoints" / "last.ckpt"
    for target in (run / "export" / "model.json", run / "checkpoints" / "best.ckpt", run / "result.json"):
        for flags in ([], ["--overwrite"]):
            res = ssogvit("eval", "--ckpt", str(ckpt), "--device", "cpu", "--json", str(target), *flags)
            assert_user_error(res, f"ssogvit eval: --json: {target} lies inside {run}, which is the folder of a run "
                                   "(it holds run.json); a run folder holds its run's files only: choose a file "
                                   "outside it")
    res = ssogvit("export", "--ckpt", str(ckpt), "--format", "torchscript")  # the default: beside the checkpoint
    assert_user_error(res, f"ssogvit export: --out: {ckpt.with_suffix('.pt')} lies inside {run}")
    assert digests() == before


def test_overwrite_never_replaces_a_node_that_is_not_a_regular_file(tiny_run, tmp_path):
    """`eval --json X --overwrite` and `export --out X --overwrite` with X a FIFO or a link: one line, exit 2, the
    node left as it was (a device at X would be replaced by a file otherwise)."""
    fifo, link = tmp_path / "fifo", tmp_path / "link.onnx"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "elsewhere.onnx")
    ckpt = str(tiny_run / "checkpoints" / "best.ckpt")
    assert_user_error(ssogvit("eval", "--ckpt", ckpt, "--json", str(fifo), "--overwrite"),
                      f"ssogvit eval: --json: {fifo} is a FIFO (named pipe), not a regular file")
    assert_user_error(ssogvit("export", "--ckpt", ckpt, "--format", "onnx", "--out", str(link), "--overwrite"),
                      f"ssogvit export: --out: {link} is a symbolic link, not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and not (tmp_path / "elsewhere.onnx").exists()


# -- data mistakes ------------------------------------------------------------------------------------------------

def _image_folder(root: Path, *, classes: int = 2, per_class: int = 4) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (16, 16), (40 * c, 10 * i, 0)).save(folder / f"{i}.png")


@pytest.mark.slow
def test_an_image_folder_class_without_images_is_refused_before_anything_is_written(tmp_path):
    _image_folder(tmp_path / "data")
    for p in (tmp_path / "data" / "val" / "class1").iterdir():
        p.unlink()
    res = ssogvit("train", "data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
                  "data.img_size=16", *TINY_MODEL, f"output_dir={tmp_path / 'run'}")
    assert_user_error(res, f"ssogvit train: class folder {tmp_path / 'data' / 'val' / 'class1'} holds no image")
    assert not (tmp_path / "run").exists()


def test_a_corrupt_image_mid_epoch_is_named_in_one_line(tmp_path):
    _image_folder(tmp_path / "data", per_class=16)
    bad = tmp_path / "data" / "train" / "class1" / "3.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    res = ssogvit("train", "data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
                  "data.img_size=16", "data.num_workers=1", "data.batch_size=4", *TINY_MODEL,
                  f"output_dir={tmp_path / 'run'}", fresh=True)  # a DataLoader worker process
    assert_user_error(res, f"ssogvit train: cannot read image {bad} (UnidentifiedImageError", mid_run=True)
    assert "DataLoader worker" not in res.stderr  # read by a worker process, reported as the worker saw it


# -- bench --------------------------------------------------------------------------------------------------------

def _results(path: Path, *, cpu: str = "test cpu", ms: float = 1.0) -> Path:
    from ssogvit.bench.runner import write_results

    rows = [dict(kind="operator", label=label, res=res, tokens=1 + (res // 16) ** 2, batch=8, mode="infer",
                 dtype="fp32", device="cpu", threads=1, status="ok", time_ms_mean=ms * (2 if label == "mha" else 1),
                 time_ms_median=ms, peak_mib=10.0, gflops_per_image=1.0, images_per_s=8000.0 / ms)
            for label in ("mha", "ssog") for res in (32, 64)]
    write_results(rows, {"cpu": cpu, "torch": "2.x", "command": "test"}, path.parent, path.stem)
    return path


@pytest.mark.slow
def test_bench_report_refuses_what_it_cannot_merge_and_names_its_rule(tmp_path):
    (tmp_path / "flops.json").write_text(json.dumps([{"model": "vit-tiny-ssog", "res": 32, "gflops": 0.05}]))
    a, b = _results(tmp_path / "a.json", ms=1.0), _results(tmp_path / "b.json", ms=3.0)
    assert_user_error(ssogvit("bench", "report", str(a), str(tmp_path / "flops.json"), "--no-plots"),
                      f"ssogvit bench: {tmp_path / 'flops.json'} is not a results file of `ssogvit bench models`")
    res = ssogvit("bench", "report", str(a), str(b), "--no-plots", "--name", "merged")
    assert res.returncode == 0, res.stderr[-3000:]
    rule = next(line for line in res.stdout.splitlines() if "measured in several files" in line)
    assert rule.startswith("# 4 point(s) measured in several files; a point measured in several files is taken "
                           "from the file given last on the command line (mha res=32 batch=8: a.json, b.json -> b.json")
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted(r["time_ms_median"] for r in merged["rows"]) == [3.0] * 4  # every point from b.json
    assert merged["meta"]["points_in_several_files"] == 4


def test_bench_operator_refuses_a_resolution_the_patch_does_not_divide(tmp_path):
    """The audit's C125: `--res 100 --patch 16` measured a 6x6 grid (96 px) and labelled it 100."""
    out = tmp_path / "out"
    assert_user_error(ssogvit("bench", "operator", "--mixers", "mha", "--res", "64", "100", "--patch", "16",
                              "--batch", "1", "--iters", "1", "--warmup", "0", "--device", "cpu", "--no-plots",
                              "--out", str(out)),
                      "ssogvit bench: --res 100 is not a multiple of --patch 16: the mixer would run on a 6x6 grid "
                      "(96 px) labelled 100; give resolutions the patch divides")
    assert not out.exists()


def test_bench_refuses_a_run_that_would_measure_nothing(tmp_path, capsys):
    """``--iters 0`` (memory only) with ``--no-memory`` wrote an empty table and plots and exited 0."""
    out = tmp_path / "out"
    assert_user_error(ssogvit("bench", "models", "--families", "vit", "--sizes", "tiny", "--res", "32", "--iters", "0",
                              "--no-memory", "--out", str(out)),
                      "ssogvit bench: --iters 0 (no timing) with --no-memory measures nothing; drop one of them")
    assert not out.exists()
    from ssogvit.bench.cli import main

    with pytest.raises(SystemExit) as refused:  # the option's declaration (ssogvit.specs), argparse's one line
        main(["operator", "--iters", "-1", "--out", str(out)])
    assert refused.value.code == 2 and not out.exists()
    assert "argument --iters: expected an integer >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_report_refuses_results_of_another_machine(tmp_path):
    a, other = _results(tmp_path / "a.json"), _results(tmp_path / "other.json", cpu="another cpu")
    assert_user_error(ssogvit("bench", "report", str(a), str(other), "--no-plots"),
                      f"ssogvit bench: {other} was measured with cpu 'another cpu' and {a} with 'test cpu'")


def test_bench_flops_check_reports_each_point_as_it_goes():
    res = ssogvit("bench", "flops", "--families", "vit", "--sizes", "tiny", "--mixers", "ssog", "--res", "32", "48",
                  "--check")
    assert res.returncode == 0, res.stderr[-3000:]
    progress = [line for line in res.stderr.splitlines() if line.startswith("[")]
    assert progress[0].startswith("[1/2] vit-tiny-ssog res=32: analytic ") and "counted" in progress[0]
    assert progress[1].startswith("[2/2] vit-tiny-ssog res=48: analytic ")


def test_options_that_would_be_ignored_or_cannot_compute_are_refused_before_any_work(lone_export, tmp_path):
    """The fifth audit's E266-E268, E279, E283, E286: `ssogvit main` overrides of what it sets for every run (`seed`,
    `output_dir`, ...), an option given twice (argparse kept the last), `--rescale-field` on a model without an SSoG
    field and `--device meta`: each one line, exit 2, before anything is written."""
    from ssogvit.models import create_model
    from ssogvit.train.io import export_safetensors

    out = tmp_path / "job"
    for override, option in (("seed=5", "--seeds"), ("output_dir=elsewhere", "--out"), ("+seed=3", "--seeds")):
        res = ssogvit("main", "--epochs", "1", "--seeds", "0", "--mixers", "ssog", "--out", str(out), override)
        assert_user_error(res, f"ssogvit main: {override!r}: ssogvit main sets ")
        assert f"use {option}" in res.stderr and not out.exists()
    res = ssogvit("eval", "--ckpt", str(lone_export), "--ckpt", str(lone_export), "--device", "cpu")
    assert_user_error(res, f"ssogvit eval: --ckpt is given twice (--ckpt {lone_export}, then --ckpt {lone_export})")
    assert_user_error(ssogvit("eval", "--ckpt", str(lone_export), "--device", "meta"),
                      "ssogvit eval: --device='meta': the meta device holds shapes and no values")
    data = json.loads(lone_export.with_suffix(".json").read_text())["data"]
    mha = export_safetensors(create_model("vit-tiny-mha", img_size=16, patch_size=4, embed_dim=32, num_heads=2,
                                          depth=1, num_classes=10), tmp_path / "mha" / "model.safetensors",
                             extra={"data": data})
    res = ssogvit("eval", "--ckpt", str(mha), "--img-size", "32", "--rescale-field", "--device", "cpu",
                  "--json", str(tmp_path / "r.json"))
    assert_user_error(res, f"ssogvit eval: --rescale-field rescales SSoG fields, and {mha} holds a model without one")
    assert not (tmp_path / "r.json").exists()


def test_report_refuses_a_run_whose_config_yaml_relabels_its_model(tiny_run, tmp_path):
    """The fifth audit's E270: a report labels runs by their config.yaml; one edited to name another mixer than the
    run's sealed export holds is refused, naming it (an MHA run was reported as SSoG)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    saved = config["model"]["name"]
    config["model"]["mixer"] = "mha" if config["model"]["mixer"] != "mha" else "ssog"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    res = ssogvit("report", str(run), "--out", str(tmp_path / "rep"))
    assert_user_error(res, f"ssogvit report: {run / 'config.yaml'} was changed since")
    assert f"model.safetensors {saved!r}" in res.stderr and not (tmp_path / "rep").exists()


def test_the_run_folder_rules_hold_through_links_dots_and_every_loader(tiny_run, tmp_path):
    """The sixth audit's F018, F020, F025, F036, F045, F054, F063: a path is judged by where it lands (`r/../x` is
    outside the run, a link into it is inside); `save_pretrained` into a run's folder is refused like every writer;
    `export` (every loader) checks the run's config.yaml against the file, a missing model section included; model
    methods' flags are checked."""
    import shutil

    from ssogvit.models import create_model
    from ssogvit.outputs import OutputError, check_output_file

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    assert check_output_file(run / ".." / "x.json") == run / ".." / "x.json"
    (tmp_path / "lnk").symlink_to(run)
    with pytest.raises(OutputError, match="the folder of a run"):
        check_output_file(tmp_path / "lnk" / "x.json")
    model = create_model("vit-tiny-ssog", img_size=16, patch_size=4, depth=1)
    for folder in (run / "sv", tmp_path / "lnk" / "sv"):
        with pytest.raises(OutputError, match="the folder of a run"):
            model.save_pretrained(folder)
    assert not (run / "sv").exists()
    for bad in (lambda: model.set_grad_checkpointing("no"), lambda: model.set_patch_size(8, rescale_field="no")):
        with pytest.raises(ValueError, match="expected true or false"):
            bad()
    config = yaml.safe_load((run / "config.yaml").read_text())
    del config["model"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    ckpt = run / "checkpoints" / "last.ckpt"
    res = ssogvit("export", "--ckpt", str(ckpt), "--format", "torchscript", "--out", str(tmp_path / "m.pt"))
    assert_user_error(res, f"ssogvit export: {run / 'config.yaml'} was changed since {ckpt} was written (config.yaml "
                           "has no model section)")
    assert not (tmp_path / "m.pt").exists()


def test_report_refuses_a_run_given_twice(tiny_run, tmp_path):
    """The sixth audit's F115-F116: one run given twice (or through a link) was reported as two."""
    (tmp_path / "lnk").symlink_to(tiny_run)
    for again in (str(tiny_run), str(tmp_path / "lnk")):
        res = ssogvit("report", str(tiny_run), again, "--out", str(tmp_path / "rep"))
        assert_user_error(res, f"ssogvit report: {again} is the run {tiny_run} again; give each run once")
    assert not (tmp_path / "rep").exists()
