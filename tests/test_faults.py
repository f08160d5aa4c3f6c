"""Faults a run must survive, through the real command line: SIGTERM / SIGINT (one line, a resumable last.ckpt),
a checkpoint changed after it was written (refused, never loaded), non-finite weights (refused), and SIGKILL at
random moments during `export`, `convert` and `transfer` (no torn file under a final name; a relaunch goes on)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ssogvit.cli import main as cli_main
from ssogvit.models import create_model
from ssogvit.outputs import is_temp_name
from ssogvit.train.run_folder import LOCK_NAME
from ssogvit.train.io import DIGEST_KEY, content_digest, export_safetensors, load_model, read_checkpoint
from ssogvit.train.resume import epochs_done

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def tiny(out: Path, *extra: str, epochs: int = 2) -> list[str]:
    """A seconds-long run: a 1-block width-32 SSoG ViT on 64 synthetic 16 px images (4 steps per epoch)."""
    return ["data=synthetic", "data.img_size=16", "data.train_size=64", "data.val_size=32", "data.batch_size=16",
            "data.learnable=true", "model=vit", "model.size=tiny", "model.mixer=ssog", "model.kwargs.embed_dim=32",
            "model.kwargs.num_heads=2", "model.kwargs.depth=1", "model.kwargs.patch_size=4",
            f"trainer.max_epochs={epochs}", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu",
            "trainer.devices=1", "ckpt.every_n_train_steps=null", f"output_dir={out}", *extra]


def popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ssogvit", *args], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, child: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.is_file(), child.communicate(timeout=60)[1][-3000:]


def last_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and sum(line.startswith("ssogvit ") for line in lines) == 1, err[-3000:]
    return lines[-1]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "run"
    assert cli_main(["train", *tiny(out)]) == 0
    return out


# -- signals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_ends_a_run_in_one_line_leaving_a_checkpoint_that_resumes_it(tmp_path, signum):
    out = tmp_path / "run"
    child = popen("train", *tiny(out, epochs=4))
    wait_for(out / "checkpoints" / "last.ckpt", child)  # one epoch has ended
    child.send_signal(signum)
    _, err = child.communicate(timeout=120)
    if child.returncode == 0:
        pytest.skip("the run finished before the signal arrived (a loaded machine)")
    assert child.returncode == 128 + signum, err[-3000:]
    line = last_line(err)
    assert line.startswith(f"ssogvit train: stopped by {signal.Signals(signum).name}; ") and "resume=auto" in line
    assert "last.ckpt" in line and "resumes the run exactly" in line
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    assert not [p for p in out.rglob("*") if is_temp_name(p.name)]
    if signum == signal.SIGINT:
        return
    # what SLURM's requeue does after its SIGTERM: the same command again (resume=auto)
    stopped = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert epochs_done(stopped) == stopped["epoch"] + 1  # saved at an epoch's end: `epoch` is the index
    done = subprocess.run([sys.executable, "-m", "ssogvit", "train", *tiny(out, epochs=4)], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'last.ckpt'} ({epochs_done(stopped)} epochs done" in done.stdout
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


# -- integrity ------------------------------------------------------------------------------------------------------


def _flip_bytes_inside(path: Path, tensor: torch.Tensor, n: int = 64) -> None:
    """Overwrite `n` bytes of `tensor`'s data where the file stores them (torch stores storages uncompressed)."""
    data = path.read_bytes()
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at > 0 and len(raw) >= n
    noise = random.Random(0).randbytes(n)
    path.write_bytes(data[:at] + noise + data[at + n:])


def test_a_checkpoint_changed_after_it_was_written_is_refused_naming_the_file(finished, tmp_path, capsys):
    last = finished / "checkpoints" / "last.ckpt"
    ckpt = read_checkpoint(last)
    assert ckpt[DIGEST_KEY] == content_digest({k: v for k, v in ckpt.items() if k != DIGEST_KEY})
    moments = next(v for v in ckpt["optimizer_states"][0]["state"].values())["exp_avg"]
    run = tmp_path / "run"  # an unfinished copy of the run whose last.ckpt took 64 random bytes in its optimizer state
    run.mkdir()
    for name in ("config.yaml", "checkpoints/last.ckpt", "checkpoints/best.ckpt"):
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_bytes((finished / name).read_bytes())
    (run / "run.json").write_text(json.dumps({"status": "running", "command": "train"}))
    _flip_bytes_inside(run / "checkpoints" / "last.ckpt", moments)
    torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)  # torch itself loads it without a word
    before = digest(run)
    assert cli_main(["eval", "--ckpt", str(run / "checkpoints" / "last.ckpt"), "--device", "cpu"]) == 2
    line = last_line(capsys.readouterr().err)
    assert f"{run / 'checkpoints' / 'last.ckpt'} fails its integrity check" in line and "was not loaded" in line
    assert cli_main(["train", *tiny(run)]) == 2  # resume=auto: refused before a resume, nothing written
    assert "fails its integrity check" in last_line(capsys.readouterr().err) and digest(run) == before
    export = tmp_path / "model.safetensors"  # an export too: its header carries the digest of its tensors
    export.write_bytes((finished / "export" / "model.safetensors").read_bytes())
    (tmp_path / "model.json").write_bytes((finished / "export" / "model.json").read_bytes())
    _flip_bytes_inside(export, load_model(finished / "export" / "model.safetensors").state_dict()["head.weight"])
    with pytest.raises(Exception, match="fails its integrity check"):
        load_model(export)


def test_non_finite_weights_are_refused_on_load(tmp_path):
    model = create_model("vit-tiny-ssog", embed_dim=32, num_heads=2, depth=1, img_size=16, patch_size=4)
    state = {"model." + k: v.clone() for k, v in model.state_dict().items()}
    state["model.head.weight"][0, 0] = float("inf")
    body = {"state_dict": state, "hyper_parameters": {"model_config": dict(model.config)}}
    torch.save({**body, DIGEST_KEY: content_digest(body)}, tmp_path / "diverged.ckpt")  # intact, but not finite
    with pytest.raises(Exception, match=r"diverged.ckpt holds non-finite weights in 1 tensor\(s\) \(head.weight\)"):
        load_model(tmp_path / "diverged.ckpt")


def test_load_model_names_folders_devices_and_missing_ema_weights(finished, tmp_path):
    from ssogvit.train import CheckpointError

    with pytest.raises(CheckpointError, match=f"{finished} is a folder, not a checkpoint; give a file in it, e.g."):
        load_model(finished)
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="map_location='cuda': CUDA is not available on this machine"):
            load_model(finished / "checkpoints" / "best.ckpt", map_location="cuda")
    with pytest.raises(CheckpointError, match="use_ema=True: .*model.safetensors holds the raw weights of a run, "
                                              "not its EMA weights; no EMA export is beside it"):
        load_model(finished / "export" / "model.safetensors", use_ema=True)
    with pytest.raises(CheckpointError, match=r"has no weights under 'ema.module.' \(trained without EMA\?\)"):
        load_model(finished / "checkpoints" / "best.ckpt", use_ema=True)


# -- SIGKILL at random moments --------------------------------------------------------------------------------------


def _kill_cycles(argv: list[str], kills: int, window: float, started: Path | None = None,
                 finished: Path | None = None) -> list[float]:
    """Launch `ssogvit ARGV` up to `kills` times, SIGKILLing each after a random delay (counted from when `started`
    exists); stops early once `finished` says the run has finished (a kill that came too late)."""
    rng, delays = random.Random(), []
    for _ in range(kills):
        child = popen(*argv)
        if started is not None:
            wait_for(started, child)
        delays.append(round(rng.uniform(0.0, window), 2))
        time.sleep(delays[-1])
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=120)
        if finished is not None and finished.is_file() and json.loads(finished.read_text())["status"] == "finished":
            break
    print(f"SIGKILLs after {delays} s")
    return delays


def _relaunch_until_finished(argv: list[str], state: Path) -> None:
    """The relaunch after the kills (none needed if the last kill came after the run finished)."""
    if state.is_file() and json.loads(state.read_text())["status"] == "finished":
        return
    done = subprocess.run([sys.executable, "-m", "ssogvit", *argv], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("kills", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_export_killed_at_random_moments_never_leaves_a_torn_file(finished, tmp_path, kills):
    out = tmp_path / "model.pt"
    argv = ["export", "--ckpt", str(finished / "export" / "model.safetensors"), "--format", "torchscript",
            "--out", str(out)]
    for delay in _kill_cycles([*argv, "--overwrite"], kills, window=8.0):
        if out.exists():  # whatever is under the final name is a whole, checked export
            torch.jit.load(str(out))
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("model.pt.")], delay
    done = subprocess.run([sys.executable, "-m", "ssogvit", *argv, "--overwrite"], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # the killed writes' temporaries went too
    assert torch.jit.load(str(out))(torch.randn(1, 3, 16, 16)).shape == (1, 10)


@pytest.mark.slow
@pytest.mark.parametrize("kills", [1, 6])
def test_transfer_killed_at_random_moments_resumes_to_the_end(finished, tmp_path, kills):
    out = tmp_path / "transfer"
    argv = ["transfer", "--ckpt", str(finished / "checkpoints" / "best.ckpt"), "--mode", "linear",
            *tiny(out, "data.num_classes=4", epochs=4)]
    _kill_cycles(argv, kills, window=3.0, started=out / "run.json", finished=out / "run.json")
    _relaunch_until_finished(argv, out / "run.json")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["command"] == "transfer"
    assert read_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 4 * 4
    assert not [p for p in out.rglob("*") if is_temp_name(p.name)]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    model = create_model("vit-tiny-mha", embed_dim=16, num_heads=2, depth=1, img_size=16, patch_size=4, in_chans=1,
                         num_classes=10)
    return export_safetensors(model, tmp_path_factory.mktemp("teacher") / "model.safetensors")


CONVERT = ["data.img_size=16", "data.batch_size=16", "data.num_workers=0", "trainer.max_epochs=2",
           "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.accelerator=cpu",
           "trainer.enable_progress_bar=false", "convert.fit_steps=5", "convert.calib_images=8"]


@pytest.mark.slow
@pytest.mark.parametrize("kills", [1, 6])
def test_convert_killed_at_random_moments_is_relaunched_without_deleting_anything(teacher, tmp_path, kills):
    out = tmp_path / "convert"
    argv = ["convert", "--teacher", str(teacher), "--out", str(out), *CONVERT]
    # from when the folder is claimed: during the field fit, its report, the epochs, the export
    _kill_cycles(argv, kills, window=4.0, started=out / "run.json", finished=out / "run.json")
    _relaunch_until_finished(argv, out / "run.json")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["command"] == "convert"
    assert load_model(out / "export" / "model.safetensors").config["name"] == "vit-tiny-ssog"
    assert (out / "fit" / "report.json").is_file() and not [p for p in out.rglob("*") if is_temp_name(p.name)]
    again = subprocess.run([sys.executable, "-m", "ssogvit", *argv], env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and "holds a finished run" in last_line(again.stderr)
