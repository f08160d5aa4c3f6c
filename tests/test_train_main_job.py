"""`ssogvit main`: the table (mean ± sd and every seed, both heads), the run folders, the curves, the target and the
refusals; the same numbers whichever process arrangement trains them; (slow) the default job meets its target."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ssogvit.train.curves import read_epoch_metrics
from ssogvit.train.main_job import load_plan, main

SHORT = ["--epochs", "1", "--seeds", "0,1", "--mixers", "ssog,mha", "--no-progress", "trainer.limit_train_batches=2",
         "trainer.limit_val_batches=1"]
ROW = r"^{model}\s+{head} {mark}\s+\d+\.\dk\s+(\d+\.\d\d) ±\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d{{4}})"


def _rows(text: str, models: tuple[str, ...] = ("vit-tiny-ssog", "vit-tiny-mha")) -> dict[tuple[str, str], tuple]:
    rows = {}
    for model, head, mark in (("vit-tiny-ssog", "avg", r"\*"), ("vit-tiny-ssog", "token", " "),
                              ("vit-tiny-mha", "token", r"\*"), ("vit-tiny-mha", "avg", " ")):
        if model not in models:
            continue
        found = re.search(ROW.format(model=model, head=head, mark=mark), text, flags=re.M)
        assert found, f"no row for {model} {head} in:\n{text}"
        rows[(model, head)] = tuple(float(g) for g in found.groups())
    return rows


def test_main_job_table_folders_curves_target_and_a_fresh_folder(tmp_path, capsys):
    out = tmp_path / "main"
    code = main(["--out", str(out), "--jobs", "2", *SHORT])
    text = capsys.readouterr().out
    assert code == 1 and "target NOT reached" in text  # two steps cannot reach the target, and the job says so
    rows = _rows(text)
    for (model, head), (mean, sd, seed0, seed1, loss) in rows.items():
        assert mean == pytest.approx((seed0 + seed1) / 2, abs=0.006) and sd >= 0 and loss > 0
        mixer = model.removeprefix("vit-tiny-")
        for seed, top1 in ((0, seed0), (1, seed1)):
            folder = out / mixer / head / f"seed{seed}"
            assert (folder / "checkpoints" / "last.ckpt").is_file()
            assert (folder / "export" / "model.safetensors").is_file()
            assert round(read_epoch_metrics(folder)["val/top1"][0], 2) == top1  # the table is the run's log
    assert f"training curves: {out / 'curves.png'}" in text
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "ssog-steered").exists()  # --mixers chose
    # the same --out again, one process instead of two: the finished runs stay as they are, the job writes to
    # <out>-2, and every number of the table is the same
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    main(["--out", str(out), "--jobs", "1", *SHORT[:-4], "ssog", *SHORT[-3:]])
    again = capsys.readouterr().out
    assert f"{out} holds another run; writing to {out}-2" in again
    assert (tmp_path / "main-2" / "ssog" / "avg" / "seed1" / "export" / "model.safetensors").is_file()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == before
    assert _rows(again, ("vit-tiny-ssog",)) == {k: v for k, v in rows.items() if k[0] == "vit-tiny-ssog"}


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "argument --epochs: expected an integer >= 1, got '0'"),
    (["--epochs", "2.5"], "argument --epochs: expected an integer >= 1, got '2.5'"),
    (["--seeds", "0,x"], "argument --seeds: expected a list of 1 or more integers in [0, 4294967295], got '0,x'"),
    (["--mixers", "ssog,foo"],
     "--mixers 'ssog,foo': unknown mixer 'foo'; expected a comma-separated list from ssog, ssog-steered, mha"),
    (["--heads", "cls"], "--heads 'cls': unknown head 'cls'; expected a comma-separated list from avg, token"),
    (["--jobs", "-1"], "argument --jobs: expected an integer >= 1"),
    (["trainer.max_epochs=0"], "trainer.max_epochs=0: expected an integer >= 1 or -1"),
])
def test_main_job_refuses_bad_arguments_in_one_line_before_writing(tmp_path, capsys, args, message):
    out = tmp_path / "main"
    try:
        code = main(["--out", str(out), *args])
    except SystemExit as stop:  # argparse's refusal (ssogvit.train.cli.ArgumentParser: one line, status 2)
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_main_job_command_line_refuses_zero_epochs_with_status_2():
    res = subprocess.run([sys.executable, "-m", "ssogvit", "main", "--epochs", "0"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == ("ssogvit main: argument --epochs: expected an integer >= 1, got '0' "
                                  "(see `ssogvit main --help`)")


def test_the_plan_is_data_and_names_packaged_experiments():
    from ssogvit.train.config import compose

    plan = load_plan()
    assert [r["experiment"] for r in plan["runs"]] == ["digits8_vit_ssog", "digits8_vit_ssog_steered",
                                                        "digits8_vit_mha"]
    assert plan["seeds"] == [0, 1, 2] and set(plan["target"]) == {"margin", "min_top1"}
    heads = {}
    for entry in plan["runs"]:
        cfg = compose([f"experiment={entry['experiment']}"])
        assert (cfg.data.img_size // cfg.model.kwargs.patch_size) == 8  # an 8x8 grid of tokens
        heads[str(cfg.model.mixer)] = str(cfg.model.kwargs.global_pool)
    assert heads == {"ssog": "avg", "ssog-steered": "avg", "mha": "token"}  # each mixer's own head


@pytest.mark.slow
def test_main_job_meets_its_target(tmp_path, capsys):
    code = main(["--out", str(tmp_path / "main"), "--no-progress"])
    text = capsys.readouterr().out
    print(text)
    assert code == 0 and "target reached" in text
