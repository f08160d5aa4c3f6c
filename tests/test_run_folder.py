"""A run's folder (`ssogvit.train.run_folder`): one set of rules for a folder a command owns (a lock that is
exclusive and never someone else's, one command and one config per folder, stale temporaries of dead writers
removed when a run begins)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ssogvit.outputs import temp_path
from ssogvit.train.run_folder import LOCK_NAME, FolderLock, RunFolder
from ssogvit.train.run_folder import RunFolderError as FolderError


def dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_folder_lock_is_exclusive_and_never_takes_a_lock_file_that_is_not_ours(tmp_path):
    with FolderLock(tmp_path / "run") as lock:  # a second open file description conflicts, as another process's
        assert lock.path.read_text().startswith(f"ssogvit pid {os.getpid()} ")
        with pytest.raises(FolderError, match=f"another live run \\(ssogvit pid {os.getpid()} on .*\\) is writing"):
            FolderLock(tmp_path / "run").__enter__()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / LOCK_NAME).write_text("held by some other tool\n")
    with pytest.raises(FolderError, match="was not written by ssogvit; it was left as it is"):
        FolderLock(theirs).__enter__()
    assert (theirs / LOCK_NAME).read_text() == "held by some other tool\n"
    with FolderLock(tmp_path / "run"):  # released with its holder
        pass


def test_a_run_folder_belongs_to_one_command_and_one_config(tmp_path):
    folder = tmp_path / "run"
    run = RunFolder(folder, command="train")
    assert run.state() == "fresh" and run.decide_resume("auto", {"a": 1}) is None
    with run.lock():
        run.begin(lambda tmp: tmp.write_text("a: 1\nresume: auto\n"))
    assert run.record()["status"] == "running" and run.record()["command"] == "train"
    assert run.decide_resume("auto", {"a": 1, "resume": "auto", "output_dir": "moved"}) is None  # no last.ckpt yet
    with pytest.raises(FolderError, match=r"holds a different run \(a: saved 1, now 2\)"):
        run.decide_resume("auto", {"a": 2})
    with pytest.raises(FolderError, match="holds an unfinished run of this config; resume it with resume=auto"):
        run.decide_resume(None, {"a": 1})
    with pytest.raises(FolderError, match="holds a run of `ssogvit train`, not of `ssogvit convert`"):
        RunFolder(folder, command="convert", elsewhere="--out <new folder>").decide_resume("auto", {"a": 1})
    run.write_state("finished")
    with pytest.raises(FolderError, match="holds a finished run"):
        run.decide_resume("auto", {"a": 1})
    (folder / "run.json").write_text(json.dumps({"status": "running"}))
    (folder / "config.yaml").write_text("a: ${oc.env:HOME}\n")
    with pytest.raises(FolderError, match="config.yaml cannot be used .*interpolation") as info:
        run.decide_resume("auto", {"a": 1})
    assert os.environ.get("HOME", "/root") not in str(info.value)


def test_a_stale_temporary_file_of_a_dead_writer_goes_when_a_run_begins(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    stale = temp_path(folder / "checkpoints" / "last.ckpt")
    stale = stale.with_name(stale.name.replace(f"-{os.getpid()}-", f"-{dead_pid()}-"))
    stale.write_bytes(b"torn")
    user = folder / "checkpoints" / ".last.ckpt.1234.tmp"
    user.write_bytes(b"the user's")
    run = RunFolder(folder, command="train")
    with run.lock():
        run.begin(lambda tmp: tmp.write_text("a: 1\n"))
    assert not stale.exists() and user.read_bytes() == b"the user's"


def test_a_finished_run_is_extended_only_when_asked_and_only_longer(tmp_path):
    """`resume=extend` (docs/training.md): a finished run trains on from its last.ckpt when only how long it trains
    grows; anything else, or a folder without a run, is refused in one line naming what to give."""
    folder = tmp_path / "run"
    run = RunFolder(folder, command="train")
    saved = {"a": 1, "trainer": {"max_epochs": 2, "max_steps": -1}}
    with pytest.raises(FolderError, match="holds no run to extend"):
        run.decide_resume("extend", saved)
    with run.lock():
        run.begin(lambda tmp: tmp.write_text("a: 1\ntrainer: {max_epochs: 2, max_steps: -1}\n"))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
    run.write_state("finished")
    longer = {"a": 1, "trainer": {"max_epochs": 5, "max_steps": -1}}
    with pytest.raises(FolderError, match="holds a finished run; .*resume=extend .*resume=new"):
        run.decide_resume("auto", longer)  # never trained on unasked
    assert run.decide_resume("extend", longer) == str(folder / "checkpoints" / "last.ckpt")
    with pytest.raises(FolderError, match="give a trainer.max_epochs above its 2"):
        run.decide_resume("extend", saved)
    with pytest.raises(FolderError, match=r"holds a different run \(a: saved 1, now 2\)"):
        run.decide_resume("extend", {**longer, "a": 2})
    with pytest.raises(FolderError, match="resume=extend is for the runs of `ssogvit train`"):
        RunFolder(folder, command="convert").decide_resume("extend", longer)
    (folder / "run.json").write_text(json.dumps({"status": "running", "command": "train"}))  # an extension killed
    assert run.decide_resume("extend", longer) == str(folder / "checkpoints" / "last.ckpt")
