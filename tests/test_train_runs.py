"""A run folder belongs to one run, resume is exact, and every bad input is a short error: through the real CLI.

The command line is run in a subprocess (`python -m ssogvit ...`) where the process matters (SIGKILL, locks,
umask, exit status without a traceback); the many bad-input cases call the same entry point in-process.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import cli_process

from ssogvit.cli import main as cli_main
from ssogvit.models.sealed import UnverifiedFileWarning
from ssogvit.train import load_model
from ssogvit.train.config import compose, quote_override
from ssogvit.outputs import is_temp_name, temp_path
from ssogvit.train.io import atomic_write, read_checkpoint
from ssogvit.train.run_folder import LOCK_NAME, config_diff, folder_state, fresh_folder, prune_logs
from ssogvit.train.run_folder import FolderLock as RunLock

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def tiny(out: Path, *extra: str, epochs: int = 2) -> list[str]:
    """A seconds-long run: a 1-block width-32 SSoG ViT on 64 synthetic 16 px images (4 steps per epoch)."""
    return [
        "data=synthetic", "data.img_size=16", "data.train_size=64", "data.val_size=32", "data.batch_size=16",
        "data.learnable=true", "model=vit", "model.size=tiny", "model.mixer=ssog", "model.kwargs.embed_dim=32",
        "model.kwargs.num_heads=2", "model.kwargs.depth=1", "model.kwargs.patch_size=4",
        f"trainer.max_epochs={epochs}", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu",
        "trainer.devices=1", "trainer.log_every_n_steps=1", "ckpt.every_n_train_steps=2", f"output_dir={out}", *extra,
    ]


def digits(out: Path, *extra: str, epochs: int = 4) -> list[str]:
    """The main job's recipe shrunk: digits with random crops, mixup/cutmix, drop path and one loader worker, so that
    the torch, numpy and Python RNGs and the workers' seeds all shape the result (epochs of 6 steps)."""
    return [
        "experiment=digits_vit_ssog", "model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2",
        "model.kwargs.drop_path_rate=0.1", "mixup.mixup_alpha=0.8", "mixup.cutmix_alpha=1.0", "data.batch_size=32",
        "data.num_workers=1", f"trainer.max_epochs={epochs}", "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        "ckpt.every_n_train_steps=2", f"output_dir={out}", *extra,
    ]


def cli(*args: str, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    """`ssogvit ARGS` in a child process (tests/cli_process.py); with `popen` arguments, `python -m ssogvit ARGS` in
    a subprocess (PYTHONPATH passed through)."""
    if not popen:
        return cli_process.run(list(args), env=ENV, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "ssogvit", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, **popen)


def assert_clear_error(proc_or_code, err: str, *needles: str) -> None:
    """Exit status 2, no traceback, the message one line `ssogvit <command>: ...` at the end of stderr (after
    Lightning's own progress lines, if a run started), each needle in it."""
    code = proc_or_code if isinstance(proc_or_code, int) else proc_or_code.returncode
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and lines and lines[-1].startswith("ssogvit "), err[-3000:]
    assert sum(line.startswith("ssogvit ") for line in lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[-1], (needle, err)


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (the lock file aside)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def val_epochs(run: Path) -> list[int]:
    """Epochs of the validation rows over every launch's CSV log, in order."""
    epochs = []
    for path in sorted((run / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with open(path, newline="") as f:
            epochs += [int(r["epoch"]) for r in csv.DictReader(f) if r.get("val/top1")]
    return epochs


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path).state_dict()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished tiny run, written by the CLI."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = cli("train", *tiny(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# exact resume ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_kills,epochs,window", [(1, 2, 2.0), pytest.param(3, 4, 3.0, marks=pytest.mark.slow),
                                                      pytest.param(10, 12, 1.5, marks=pytest.mark.slow)])
def test_sigkilled_run_resumed_many_times_equals_the_uninterrupted_run(tmp_path, max_kills, epochs, window):
    """SIGKILL at random moments over several launches, then a launch that finishes: same steps, every validation
    epoch logged once, bit-identical weights to one uninterrupted launch (same machine, threads, workers)."""
    ref = tmp_path / "ref"
    assert cli_main(["train", *digits(ref, epochs=epochs)]) == 0  # in this process: one thread, as in the subprocesses
    run, rng, kills, delays = tmp_path / "killed", random.Random(), 0, []
    for _ in range(max_kills + 10):
        child = subprocess.Popen([sys.executable, "-m", "ssogvit", "train", *digits(run, epochs=epochs)], env=ENV,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < max_kills:
            deadline = time.monotonic() + 120  # the folder is claimed: the lock holds the child's pid
            while time.monotonic() < deadline and child.poll() is None:
                lock = run / LOCK_NAME
                if lock.is_file() and f"pid {child.pid} " in lock.read_text():
                    break
                time.sleep(0.02)
            delays.append(round(rng.uniform(0.0, window), 2))
            time.sleep(delays[-1])
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
                kills += 1
        _, err = child.communicate(timeout=300)
        if child.returncode == 0:
            break
        assert child.returncode == -signal.SIGKILL, err[-3000:]
        state = run / "run.json"
        if state.is_file() and json.loads(state.read_text())["status"] == "finished":
            break  # the kill landed after the run had finished (while the process was exiting): nothing to resume
    print(f"SIGKILLs survived: {kills} (after {delays} s)")
    assert json.loads((run / "run.json").read_text())["status"] == "finished" and kills >= 1, (kills, delays)
    last = read_checkpoint(run / "checkpoints" / "last.ckpt")
    ref_last = read_checkpoint(ref / "checkpoints" / "last.ckpt")
    assert last["global_step"] == ref_last["global_step"] == 6 * epochs and last["epoch"] == ref_last["epoch"] == epochs
    assert val_epochs(run) == val_epochs(ref) == list(range(epochs)), (val_epochs(run), kills, delays)
    a, b = weights(ref / "export" / "model.safetensors"), weights(run / "export" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), (kills, delays)
    for k, v in b.items():  # last.ckpt is the final state: the exported weights
        assert torch.equal(last["state_dict"]["model." + k], v), k
    assert not [p for p in run.rglob("*") if is_temp_name(p.name)]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


def test_a_run_without_validation_claims_no_best_checkpoint(tmp_path, capsys):
    """`trainer.limit_val_batches=0`: the summary said "best top-1 nan%" and named a best.ckpt that was never written,
    and run.json held NaN (not JSON)."""
    out = tmp_path / "run"
    assert cli_main(["train", *tiny(out, "trainer.limit_val_batches=0", epochs=1)]) == 0
    text = capsys.readouterr().out
    assert "(best top-1 n/a: no validation ran)" in text and "(last.ckpt)" in text and "nan" not in text
    assert not (out / "checkpoints" / "best.ckpt").exists()
    assert json.loads((out / "run.json").read_text(), parse_constant=lambda c: pytest.fail(c))["best"] is None


def test_a_finished_runs_checkpoint_counts_its_epochs(finished):
    """A resume from a finished 1-epoch run's last.ckpt said "2 epochs done": at the end of training the checkpoint's
    `epoch` is the count, not the index."""
    from ssogvit.train.resume import epochs_done

    last = read_checkpoint(finished / "checkpoints" / "last.ckpt")
    assert epochs_done(last) == last["epoch"] == 2


def test_a_job_of_several_runs_never_writes_into_a_run_folder(finished):
    """`ssogvit main --out <a finished train run>` wrote its runs and tables inside that run: the base folder itself
    must hold no run, not only the parts the job writes."""
    assert fresh_folder(finished, parts=("ssog/avg/seed0",)) == finished.with_name(f"{finished.name}-2")
    assert fresh_folder(finished.parent / "new", parts=("ssog/avg/seed0",)) == finished.parent / "new"


def test_stale_temp_files_go_and_a_mid_epoch_checkpoint_does_not_resume(tmp_path):
    out = tmp_path / "run"
    proc = cli("train", *tiny(out, epochs=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a run killed during its writes: unfinished, with the temporary files of the writes it never renamed (named by
    # a process that is gone), beside a user's own files with temporary-looking names, which are never touched
    (out / "run.json").write_text(json.dumps({"status": "running"}))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [temp_path(out / "checkpoints" / "last.ckpt"), temp_path(out / "export" / "model.safetensors")]
    stale = [p.with_name(p.name.replace(f"-{os.getpid()}-", f"-{dead.stdout.strip()}-")) for p in stale]
    mine = [out / ".notes.tmp", out / "checkpoints" / ".last.ckpt.abc123.tmp"]
    for p in stale + mine:
        p.write_bytes(b"half a file")
    # step=*.ckpt was taken mid-epoch: its data order cannot be reproduced, so it cannot resume
    code = cli_main(["train", *tiny(out, epochs=1), f"resume={out / 'checkpoints' / 'step=0000002.ckpt'}"])
    assert code == 2
    assert all(p.exists() for p in stale + mine)  # a refused launch touches nothing
    assert cli_main(["train", *tiny(out, epochs=1)]) == 0  # resume=auto: the last epoch-end checkpoint
    assert not any(p.exists() for p in stale) and all(p.read_bytes() == b"half a file" for p in mine)


def test_resume_message_for_mid_epoch_checkpoint(tmp_path, capsys, finished):
    ckpt = sorted((finished / "checkpoints").glob("step=*.ckpt"))[0]
    code = cli_main(["train", *tiny(tmp_path / "new"), f"resume={ckpt}"])
    assert_clear_error(code, capsys.readouterr().err, "not saved at the end of a training epoch", "last.ckpt")
    assert not (tmp_path / "new").exists()


def test_a_resume_that_changes_the_runs_settings_is_refused_naming_them(tmp_path, capsys, finished):
    """The audit's B74: `resume=<its last.ckpt>` elsewhere with another learning rate recorded the new rate, while
    the optimizer state restored from the checkpoint kept training at the old one. A resume may change only what
    `resume_may_change` declares (how long it trains, where things are and how they are shown)."""
    last = finished / "checkpoints" / "last.ckpt"
    code = cli_main(["train", *tiny(tmp_path / "new", "optim.lr=0.0123", f"resume={last}", epochs=3)])
    assert_clear_error(code, capsys.readouterr().err, f"resume={last} continues its run with that run's settings",
                       "optim.lr: run 0.001, now 0.0123", "start a new try with resume=new")
    assert not (tmp_path / "new").exists()
    code = cli_main(["train", *tiny(tmp_path / "longer", "data.num_workers=0", f"resume={last}", epochs=3)])
    assert code == 0 and "resuming from" in capsys.readouterr().out  # only trainer.max_epochs and where: resumed


def test_csv_rows_of_a_lost_attempt_are_dropped_on_resume(tmp_path):
    log = tmp_path / "logs" / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    log.write_text("epoch,lr,step,val/top1\n0,,3,50\n,0.1,4,\n1,,7,60\n,0.1,8,\n2,,1")  # last line torn by a kill
    prune_logs(tmp_path, epoch=0, step=4)
    assert log.read_text().splitlines() == ["epoch,lr,step,val/top1", "0,,3,50"]


# one run per folder ---------------------------------------------------------------------------------------------------
def test_a_finished_run_is_never_overwritten(finished, tmp_path):
    before = digest(finished)
    for extra in ([], ["resume=null"], ["resume=auto"], ["trainer.max_epochs=5"]):
        proc = cli("train", *tiny(finished, *extra))
        assert_clear_error(proc, proc.stderr, "holds a finished run", "ssogvit eval", "output_dir=")
        assert "GPU available" not in proc.stdout + proc.stderr  # Lightning's banner only for a run that goes ahead
        break  # one subprocess shows the exit status and the message; the rest in-process below
    for extra in (["resume=null"], ["resume=auto"], ["trainer.max_epochs=5"], ["data.img_size=32"]):
        assert cli_main(["train", *tiny(finished, *extra)]) == 2
    assert digest(finished) == before


def test_a_run_killed_after_its_export_but_before_run_json_said_finished_loses_nothing(finished, tmp_path, capsys):
    """The fifth audit's E296: a run whose run.json still says 'running' though its last.ckpt holds the whole budget
    and its export was written after it (a kill between the two) was fitted again: nothing trained, but the export was
    rewritten without its train and validation metrics, last.ckpt was rewritten and the best score lost. The same
    command now only records the run as finished, from its checkpoint and export."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    state = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**state, "status": "running"}))
    kept = ("run.json", "config.yaml")  # config.yaml is written again as any launch writes it (its output_dir here)
    before = {k: v for k, v in digest(run).items() if k not in kept}
    assert cli_main(["train", *tiny(run)]) == 0
    assert "the run had finished; nothing is trained or rewritten" in capsys.readouterr().out
    assert {k: v for k, v in digest(run).items() if k not in kept} == before
    after = json.loads((run / "run.json").read_text())
    assert after["status"] == "finished" and after["best"] == state["best"] and after["steps"] == state["steps"]


def test_a_finished_run_is_extended_or_tried_again_in_one_command(tmp_path, capsys):
    """docs/training.md: `resume=extend trainer.max_epochs=N` trains a finished run on in its folder; `resume=new`
    starts a new try beside it (`<folder>-2`) without touching it. The console of the run (lines mode) shows each of
    Lightning's lines once and the time left."""
    out = tmp_path / "run"
    assert cli_main(["train", *tiny(out, epochs=1)]) == 0
    proc = cli("train", *tiny(out, "resume=extend", "trainer.enable_progress_bar=true", "progress.mode=lines",
                              epochs=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["epochs"], val_epochs(out)) == ("finished", 3, [0, 1, 2])
    console = proc.stdout + proc.stderr
    assert console.count("GPU available") == 1 and console.count("Total params") == 1, console  # each line once
    assert "(1 epochs done, step 4)" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"] and lines[0].endswith(" left)"), lines
    before = digest(out)
    capsys.readouterr()
    assert cli_main(["train", *tiny(out, "resume=new", epochs=1)]) == 0
    assert f"this new try writes to {out}-2" in capsys.readouterr().out
    assert digest(out) == before and folder_state(tmp_path / "run-2") == "finished"
    assert cli_main(["train", *tiny(out, "resume=extend", epochs=3)]) == 2  # not longer than it is: refused
    assert_clear_error(2, capsys.readouterr().err, "trainer.max_epochs above its 3")
    assert digest(out) == before


def test_a_failed_launch_writes_nothing(finished, tmp_path, capsys):
    """The issue's case: a launch that cannot run (here a different image size into an unfinished run) fails before it
    writes anything, so `ssogvit eval` on the run still reports the run's own accuracy."""
    (finished / "run.json").write_text(json.dumps({"status": "running"}))  # as if killed before it finished
    try:
        before = digest(finished)
        ckpt = finished / "checkpoints" / "best.ckpt"
        res = tmp_path / "eval.json"
        assert cli_main(["eval", "--ckpt", str(ckpt), "--device", "cpu", "--json", str(res)]) == 0
        top1 = json.loads(res.read_text())["top1"]
        capsys.readouterr()
        assert cli_main(["train", *tiny(finished, "data.img_size=32")]) == 2
        assert_clear_error(2, capsys.readouterr().err, "holds a different run", "data.img_size: saved 16, now 32")
        assert cli_main(["train", *tiny(finished, "resume=null")]) == 2
        assert_clear_error(2, capsys.readouterr().err, "unfinished run", "resume=auto")
        assert digest(finished) == before
        assert cli_main(["eval", "--ckpt", str(ckpt), "--device", "cpu", "--json", str(res), "--overwrite"]) == 0
        assert json.loads(res.read_text())["top1"] == top1
    finally:
        (finished / "run.json").write_text(json.dumps({"status": "finished"}))
    # a launch into a new folder that fails (no such dataset) leaves no folder behind
    nowhere, out = tmp_path / "nowhere", tmp_path / "x"
    assert cli_main(["train", "data=cifar100", f"data.root={nowhere}", f"output_dir={out}"]) == 2
    assert not (tmp_path / "x").exists()


def test_a_folder_with_run_files_but_no_config_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step=0000500.ckpt").write_bytes(b"x")
    assert cli_main(["train", *tiny(out)]) == 2
    assert_clear_error(2, capsys.readouterr().err, "files of another run", "checkpoints")
    assert folder_state(out) == "foreign" and sorted(p.name for p in out.iterdir()) == ["checkpoints"]
    (tmp_path / "file").write_text("x")  # output_dir names a file
    assert cli_main(["train", *tiny(tmp_path / "file")]) == 2
    assert_clear_error(2, capsys.readouterr().err, "is a file, not a folder")
    assert (tmp_path / "file").read_text() == "x"


def test_a_live_run_holds_its_folder(tmp_path):
    out = tmp_path / "run"
    with RunLock(out):  # this process is the live run
        proc = cli("train", *tiny(out))
        assert_clear_error(proc, proc.stderr, "another live run", f"pid {os.getpid()}")
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    # the lock goes with the process that held it: a SIGKILLed holder leaves nothing stale behind
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(out / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Exception, match="another live run"):
        RunLock(out).__enter__()
    holder.kill()
    holder.wait()
    with RunLock(out):
        pass


def test_two_concurrent_launches_into_one_folder(tmp_path):
    out = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-m", "ssogvit", "train", *tiny(out, epochs=3)], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    err = next(e for c, e in results if c == 2)
    assert_clear_error(2, err)
    assert "another live run" in err or "holds a finished run" in err, err
    assert val_epochs(out) == [0, 1, 2]  # one run's log, each epoch once


def test_different_config_into_an_unfinished_run_names_the_keys(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    OmegaConf.save(compose(tiny(out, "seed=1")), out / "config.yaml", resolve=True)  # killed before any checkpoint
    assert cli_main(["train", *tiny(out)]) == 2
    assert_clear_error(2, capsys.readouterr().err, "holds a different run", "seed: saved 1, now 42")
    assert config_diff({"a": {"b": 1}, "resume": "auto"}, {"a": {"b": 2}, "resume": None}) == ["a.b: saved 1, now 2"]


def test_transfer_from_two_sources_never_shares_a_folder(finished, tmp_path, monkeypatch):
    """The issue's case: a second `transfer --ckpt B` must not resume the first one's run and report A's score."""
    # no output_dir: transfer picks one
    common = [o for o in tiny(tmp_path, "data.num_classes=4", epochs=1) if not o.startswith("output_dir=")]
    a, b = finished / "checkpoints" / "best.ckpt", finished / "export" / "model.safetensors"
    runs = []
    monkeypatch.chdir(tmp_path)
    for src in (a, b, a):
        assert cli_main(["transfer", "--ckpt", str(src), "--mode", "linear", *common]) == 0
        runs.append(sorted(p.name for p in (tmp_path / "runs").iterdir()))
    assert runs[-1] == ["transfer_linear_synthetic_run_best", "transfer_linear_synthetic_run_best-2",
                        "transfer_linear_synthetic_run_model"]
    cfg = json.loads((tmp_path / "runs" / "transfer_linear_synthetic_run_model" / "export" / "model.json").read_text())
    assert cfg["run"] == "transfer_linear_synthetic_run_model"


# non-finite, umask ------------------------------------------------------------------------------------------------
def test_a_diverged_run_stops_and_exports_nothing(tmp_path):
    out = tmp_path / "run"
    proc = cli("train", *tiny(out, "optim.lr=1e6", epochs=3))
    assert_clear_error(proc, proc.stderr, "diverged", "non-finite" if "weights" in proc.stderr else "loss is")
    assert not (out / "export").exists() and json.loads((out / "run.json").read_text())["status"] == "running"
    for ckpt in (out / "checkpoints").glob("*.ckpt"):  # whatever was saved before is finite
        assert all(torch.isfinite(v).all() for v in read_checkpoint(ckpt)["state_dict"].values()), ckpt


def test_a_non_finite_model_is_never_exported(tmp_path):
    from ssogvit.models import create_model
    from ssogvit.train import NonFiniteError, export_safetensors

    model = create_model("vit-tiny-ssog", embed_dim=32, num_heads=2, depth=1, img_size=16, patch_size=4)
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="non-finite"):
        export_safetensors(model, tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_files_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "f", lambda tmp: Path(tmp).write_text("x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o666 & ~umask


def test_the_folder_is_flushed_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        synced.append(("dir" if is_dir else "file", (tmp_path / "f").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "f", lambda tmp: Path(tmp).write_text("x"))
    assert synced == [("file", False), ("dir", True)]  # the data before the rename, the folder's entry after it


@pytest.mark.slow
def test_a_run_writes_group_readable_files_under_umask_002(tmp_path):
    out = tmp_path / "run"
    proc = cli("train", *tiny(out, epochs=1), preexec_fn=lambda: os.umask(0o002))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "export/model.safetensors", "export/model.json",
                 "config.yaml", "run.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o664, name


# paths with '=', refused and oversized files -------------------------------------------------------------------------
def test_paths_with_equals_signs_work_everywhere(finished, tmp_path, capsys):
    root = tmp_path / "a=b,c [d]"  # a run folder, found by eval through the path
    ckpt = root / "checkpoints" / "step=0000002.ckpt"
    ckpt.parent.mkdir(parents=True)
    (root / "config.yaml").write_bytes((finished / "config.yaml").read_bytes())
    ckpt.write_bytes(sorted((finished / "checkpoints").glob("step=*.ckpt"))[0].read_bytes())
    res = tmp_path / "r.json"
    assert cli_main(["eval", "--ckpt", str(ckpt), "--device", "cpu", "--json", str(res)]) == 0
    assert json.loads(res.read_text())["ckpt"] == str(ckpt)
    # data.root=<path with '=' ',' and brackets> arrives intact: the missing-dataset message names it exactly
    assert cli_main(["train", "data=cifar100", f"data.root={root}", f"output_dir={tmp_path / 'c'}"]) == 2
    assert str(root) in capsys.readouterr().err
    out = root / "transfer=1"
    proc = cli("transfer", "--ckpt", str(ckpt), *tiny(out, "data.num_classes=4", epochs=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "export" / "model.json").read_text())["model_config"]["num_classes"] == 4
    # resume=<path with '='> reaches the resume check (a mid-epoch checkpoint: refused for that reason, not a parse)
    assert cli_main(["train", *tiny(tmp_path / "r=2"), f"resume={ckpt}"]) == 2
    for value in ("/x/step=0000100.ckpt", "/a,b/c", "/it's/[x]", "/a\\'b", "/${x}"):
        for key in ("resume", "output_dir", "data.root", "transfer.ckpt"):
            quoted = quote_override(f"{key}={value}")
            if "${" in value:
                assert quoted == f"{key}={value}"  # a Hydra interpolation is left to Hydra
            else:
                assert OmegaConf.select(compose([f"{key}={value}", "data=synthetic"]), key) == value


def test_a_refused_pickle_is_a_clear_error_without_unsafe_advice(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"state_dict": {}, "hyper_parameters": {"x": Evil()}}, tmp_path / "evil.ckpt")
    proc = cli("eval", "--ckpt", str(tmp_path / "evil.ckpt"))
    assert_clear_error(proc, proc.stderr, "refused to load", "posix.system")
    assert "weights_only=False" not in proc.stderr + proc.stdout and not (tmp_path / "pwned").exists()


def _fake_ckpt(path: Path, config: dict) -> Path:
    torch.save({"state_dict": {}, "hyper_parameters": {"model_config": config}}, path)
    return path


@pytest.mark.parametrize("config,needles", [
    ({"name": "vit-base-ssog", "embed_dim": 65536, "depth": 96}, ["embed_dim=65536", "[1, 8192]"]),
    ({"name": "vit-base-ssog", "depth": 10**9}, ["depth=1000000000", "[1, 1024]"]),
    ({"name": "vit-base-ssog", "img_size": -1}, ["img_size=-1"]),
    ({"name": "vit-base-ssog", "num_classes": 1.5e12}, ["num_classes"]),
    ({"name": "vit-base-ssog", "mlp_ratio": float("nan")}, ["mlp_ratio"]),
    ({"name": "vit-base-ssog", "embed_dim": 8192, "num_heads": 64, "depth": 96}, ["parameters", "1,000,000,000"]),
    ({"name": "vit-huge-ssog"}, ["unknown model"]),
    ({"name": ["vit-base-ssog"]}, ["must be a dict with a 'name'"]),
    ({"name": "vit-base-ssog", "bogus": 1}, ["does not build", "bogus"]),
])
def test_model_configs_from_files_are_checked_before_building(tmp_path, capsys, config, needles):
    ckpt = _fake_ckpt(tmp_path / "small.ckpt", config)
    assert ckpt.stat().st_size < 4096  # a small file ...
    assert cli_main(["eval", "--ckpt", str(ckpt), "--device", "cpu"]) == 2  # ... never builds a huge model
    assert_clear_error(2, capsys.readouterr().err, str(ckpt), *needles)


# every other bad input: one or two lines, exit status 2 ------------------------------------------------------------
BAD_INPUTS = [
    (["train", "nonsense_key=1"], ["nonsense_key"]),
    (["train", "data=nope"], ["nope"]),
    (["train", "experiment=nope"], ["nope"]),
    (["train", "model.kwargs.embed_dim=-4", "model.size=tiny", "data=synthetic"], ["cannot be built"]),
    (["train", "+model.kwargs.bogus=1", "data=synthetic"], ["bogus"]),
    (["train", "data=cifar100", "data.root=/nonexistent/cifar"], ["cifar"]),
    (["train", "resume=/nonexistent/last.ckpt", "data=synthetic"], ["does not exist"]),
    (["train", "--bogus"], ["unknown option --bogus"]),
    (["train", "just-a-word"], ["not an override"]),
    (["train", "trainer.max_epochs=[1"], []),
    (["eval", "--ckpt", "/nonexistent/x.ckpt"], ["does not exist"]),
    (["eval", "--ckpt", "/nonexistent/x.safetensors"], ["does not exist"]),
    (["eval", "--ckpt", "x.ckpt", "foo=1"], ["unknown argument 'foo=1'"]),
    (["eval", "--ckpt", "x.ckpt", "--img_size", "3"], ["unknown argument '--img_size'"]),
    (["transfer", "--ckpt", "/nonexistent/x.ckpt", "data=synthetic"], ["does not exist"]),
    # an override of what an option of transfer sets contradicts it (the run used to follow one and be named by
    # the other)
    (["transfer", "--ckpt", "a.ckpt", "--mode", "linear", "transfer.mode=finetune"], ["contradicts --mode"]),
    (["transfer", "--ckpt", "a.ckpt", "+transfer.ckpt=b.ckpt"], ["contradicts --ckpt", "give it there, once"]),
    (["main", "--mixers", "ssog,foo"], ["unknown mixer"]),
]
# values a run config may not take, on top of a run that is otherwise fine: refused before anything is written
SYN = ["data=synthetic", "data.img_size=16", "model.size=tiny", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2",
       "model.kwargs.depth=1", "model.kwargs.patch_size=4", "trainer.accelerator=cpu"]
BAD_INPUTS += [([*SYN, override], [needle]) for override, needle in [
    ("trainer.max_epochs=-5", "trainer.max_epochs=-5"), ("trainer.max_epochs=abc", "trainer.max_epochs"),
    ("data.batch_size=0", "data.batch_size=0"), ("data.num_workers=-1", "data.num_workers"),
    ("data.train_size=0", "train_size=0"), ("data.in_chans=0", "data.in_chans=0"), ("optim.lr=nan", "optim.lr=nan"),
    ("optim.lr=-1", "optim.lr=-1"), ("optim.opt=nope", "optim.opt"), ("seed=abc", "seed"),
    ("sched.warmup_epochs=-1", "sched.warmup_epochs"), ("loss.smoothing=2", "loss.smoothing"),
    ("loss.jasmin.reduce=sum", "loss.jasmin.reduce"), ("mixup.mixup_alpha=-1", "mixup.mixup_alpha"),
    ("ema.decay=2", "ema.decay"), ("ckpt.monitor=val/loss", "ckpt.monitor"), ("ckpt.monitor=val_ema/top1", "ema"),
    ("ckpt.keep=-5", "ckpt.keep"), ("ckpt.every_n_train_steps=-1", "every_n_train_steps"),
    ("trainer.accumulate_grad_batches=0", "accumulate_grad_batches"), ("trainer.gradient_clip_val=-1", "clip"),
    ("trainer.devices=0", "devices=0"), ("trainer.precision=foo", "Precision 'foo'"),
    ("transfer.mode=bogus", "transfer.mode"),
    ("model.kwargs.patch_size=5", "patch_size 5 does not divide img_size (16, 16)"),
    ("model.kwargs.embed_dim=0", "embed_dim=0"), ("model.kwargs.num_heads=3", "divisible by num_heads"),
    ("model.kwargs.depth=0", "depth"), ("model.size=huge", "unknown size"), ("model.mixer=foo", "unknown mixer"),
    ("output_dir= ", "output_dir is empty"),
    # contradictory settings (ssogvit.train.settings.CONSTRAINTS), refused together before anything is written
    ("trainer.max_epochs=-1", "the run would never end"), ("trainer.limit_train_batches=0", "would train nothing"),
    ("model.kwargs.num_classes=5", "model.kwargs.num_classes differs from data.num_classes"),
    # the audit's C093: a linear probe of nothing was recorded while everything trained
    ("transfer.mode=linear", "transfer.mode / transfer.use_ema without transfer.ckpt"),
    ("transfer.use_ema=true", "transfer.mode / transfer.use_ema without transfer.ckpt"),
]]


@pytest.mark.parametrize("argv,needles", BAD_INPUTS, ids=[" ".join(a[-2:])[:50] for a, _ in BAD_INPUTS])
def test_bad_inputs_are_short_errors(argv, needles, tmp_path, capsys):
    if argv[0] not in ("train", "eval", "transfer", "main"):  # run config overrides
        argv = ["train", *argv]
    if argv[0] == "train" and not any(a.startswith("output_dir=") for a in argv):
        argv = [*argv, f"output_dir={tmp_path / 'out'}"]
    try:
        code = cli_main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert_clear_error(code, capsys.readouterr().err, *needles)
    assert not (tmp_path / "out").exists()


def test_bad_files_are_short_errors(finished, tmp_path, capsys):
    cases = {
        "empty.ckpt": b"",
        "torn.ckpt": (finished / "checkpoints" / "best.ckpt").read_bytes()[:5000],
        "text.ckpt": b"hello",
        "torn.safetensors": (finished / "export" / "model.safetensors").read_bytes()[:100],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert cli_main(["eval", "--ckpt", str(tmp_path / name), "--device", "cpu"]) == 2, name
        assert_clear_error(2, capsys.readouterr().err, name)
    torch.save([1, 2], tmp_path / "list.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "nocfg.ckpt")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.safetensors").write_bytes((finished / "export" / "model.safetensors").read_bytes())
    for name, needle in (("list.ckpt", "not a Lightning checkpoint"), ("nocfg.ckpt", "no model_config"),
                         ("bad.safetensors", "cannot read the config")):
        assert cli_main(["eval", "--ckpt", str(tmp_path / name), "--device", "cpu"]) == 2, name
        assert_clear_error(2, capsys.readouterr().err, needle)
    (tmp_path / "alone.ckpt").write_bytes((finished / "checkpoints" / "best.ckpt").read_bytes())
    assert cli_main(["eval", "--ckpt", str(tmp_path / "alone.ckpt"), "--device", "cpu"]) == 0  # its own data record
    capsys.readouterr()
    from ssogvit.train.io import DIGEST_KEY, content_digest

    body = {k: v for k, v in torch.load(tmp_path / "alone.ckpt", weights_only=True).items() if k != DIGEST_KEY}
    del body["hyper_parameters"]["data"]  # a checkpoint written before they recorded their data
    torch.save({**body, DIGEST_KEY: content_digest(body)}, tmp_path / "older.ckpt")
    assert cli_main(["eval", "--ckpt", str(tmp_path / "older.ckpt"), "--device", "cpu"]) == 2  # never a guessed dataset
    assert_clear_error(2, capsys.readouterr().err, "no data config beside", "data=")
    older_run = tmp_path / "older_run"  # the same in its run folder: the run's config.yaml, named as unverified
    (older_run / "checkpoints").mkdir(parents=True)
    (older_run / "config.yaml").write_bytes((finished / "config.yaml").read_bytes())
    (older_run / "checkpoints" / "last.ckpt").write_bytes((tmp_path / "older.ckpt").read_bytes())
    with pytest.warns(UnverifiedFileWarning, match="written before ssogvit sealed a run's data settings"):
        assert cli_main(["eval", "--ckpt", str(older_run / "checkpoints" / "last.ckpt"), "--device", "cpu"]) == 0
    capsys.readouterr()
    for argv in (["--img-size", "0"], ["--patch-size", "-2"], ["--patch-size", "5"]):
        try:
            code = cli_main(["eval", "--ckpt", str(finished / "checkpoints" / "best.ckpt"), "--device", "cpu", *argv])
        except SystemExit as exit_:
            code = exit_.code
        assert_clear_error(code, capsys.readouterr().err)
