"""`ssogvit main`: the comparison tables (test top-1 with 95% intervals, paired gaps, learning speed), the run
folders, comparison.md and the curves, exit 0 whatever the comparison shows, the same numbers whichever process
arrangement trains them, and the refusals."""

from __future__ import annotations

import re
import sys

import pytest

import cli_process

from ssogvit.train.main_job import load_plan, main
from ssogvit.train.report import read_run

SHORT = ["--epochs", "1", "--seeds", "0,1", "--mixers", "ssog,mha", "--no-progress", "trainer.limit_train_batches=2",
         "trainer.limit_val_batches=1"]
# a row of the models table: | vit | avg | ssog | 12.34 ± 5.67 | 10.00, 14.68 | ... |
ROW = r"^\| vit \| {head} \| {mixer} \| (-?\d+\.\d\d) ± (\d+\.\d\d|nan) \| (\d+\.\d\d), (\d+\.\d\d) \|"
GAP = r"^\| vit \| own \(avg vs token\) \| ssog - mha \| \*\*([-+]\d+\.\d\d) ± (\d+\.\d\d|nan)\*\* \| ([-+]\d+\.\d\d), ([-+]\d+\.\d\d) \| ssog (leads|trails|no clear difference) \|"


def _rows(text: str, mixers: tuple[str, ...] = ("ssog", "mha")) -> dict[str, tuple]:
    rows = {}
    for mixer, head in (("ssog", "avg"), ("mha", "token")):
        if mixer not in mixers:
            continue
        found = re.search(ROW.format(mixer=mixer, head=head), text, flags=re.M)
        assert found, f"no row for {mixer} {head} in:\n{text}"
        rows[mixer] = found.groups()
    return rows


def test_main_job_tables_folders_curves_exit_0_and_a_fresh_folder(tmp_path, capsys):
    out = tmp_path / "main"
    code = main(["--out", str(out), "--jobs", "2", *SHORT])
    text = capsys.readouterr().out
    assert code == 0  # every run finished: the job succeeds whatever the comparison shows
    rows = _rows(text)
    for mixer, (mean, half, seed0, seed1) in rows.items():
        assert float(mean) == pytest.approx((float(seed0) + float(seed1)) / 2, abs=0.006)
        head = "avg" if mixer == "ssog" else "token"
        for seed, top1 in ((0, seed0), (1, seed1)):
            folder = out / mixer / head / f"seed{seed}"
            assert (folder / "checkpoints" / "last.ckpt").is_file()
            assert (folder / "export" / "model.safetensors").is_file()
            assert f"{read_run(folder).test_top1:.2f}" == top1  # the table is the run's logged test top-1
    gap = re.search(GAP, text, flags=re.M)
    assert gap, text
    per_seed = [float(rows["ssog"][2]) - float(rows["mha"][2]), float(rows["ssog"][3]) - float(rows["mha"][3])]
    assert [float(gap.group(3)), float(gap.group(4))] == pytest.approx(per_seed, abs=0.011)  # paired by seed
    assert float(gap.group(1)) == pytest.approx(sum(per_seed) / 2, abs=0.011)
    assert (out / "comparison.md").read_text().startswith("Each model's test top-1")
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
    assert _rows(again, ("ssog",)) == {"ssog": rows["ssog"]}


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "argument --epochs: expected an integer >= 1, got '0'"),
    (["--epochs", "2.5"], "argument --epochs: expected an integer >= 1, got '2.5'"),
    (["--seeds", "0,x"], "argument --seeds: expected a list of 1 or more distinct integers in [0, 4294967295], got '0,x'"),
    (["--mixers", "ssog,foo"],
     "--mixers 'ssog,foo': unknown mixer 'foo'; expected a comma-separated list from ssog, ssog-steered, mha"),
    (["--heads", "cls"], "--heads 'cls': unknown head 'cls'; expected a comma-separated list from avg, token"),
    (["--seeds", "0,0"], "argument --seeds: expected a list of 1 or more distinct integers in [0, 4294967295], "
                         "got '0,0'"),  # two runs of one seed raced one folder
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
    res = cli_process.run(["main", "--epochs", "0"], timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == ("ssogvit main: argument --epochs: expected an integer >= 1, got '0' "
                                  "(see `ssogvit main --help`)")


def test_the_plan_is_data_and_names_packaged_experiments():
    from ssogvit.train.config import compose

    plan = load_plan()
    assert [r["experiment"] for r in plan["runs"]] == ["digits8_vit_ssog", "digits8_vit_ssog_steered",
                                                        "digits8_vit_mha"]
    assert plan["seeds"] == [0, 1, 2] and "target" not in plan  # no gate on the science
    heads = {}
    for entry in plan["runs"]:
        cfg = compose([f"experiment={entry['experiment']}"])
        assert (cfg.data.img_size // cfg.model.kwargs.patch_size) == 8  # an 8x8 grid of tokens
        heads[str(cfg.model.mixer)] = str(cfg.model.kwargs.global_pool)
        assert entry["heads"] == [heads[str(cfg.model.mixer)]]  # each trained with its own head
    assert heads == {"ssog": "avg", "ssog-steered": "avg", "mha": "token"}  # each mixer's own head


@pytest.mark.slow
def test_the_default_main_job_finishes_with_status_0(tmp_path, capsys):
    code = main(["--out", str(tmp_path / "main"), "--no-progress"])
    text = capsys.readouterr().out
    print(text)
    assert code == 0 and "ssog-steered - mha" in text and (tmp_path / "main" / "comparison.md").is_file()


@pytest.mark.parametrize("mixer, pool, head", [("ssog", None, "avg"), ("mha", None, "token"), ("ssog", "token",
                                                                                               "token")])
def test_an_experiment_without_a_head_is_labelled_with_the_head_its_model_builds(monkeypatch, mixer, pool, head):
    from omegaconf import OmegaConf

    import ssogvit.train.config as config
    from ssogvit.train.main_job import experiment_model

    cfg = OmegaConf.create({"model": {"mixer": mixer, "kwargs": {"global_pool": pool}}})
    monkeypatch.setattr(config, "compose", lambda overrides: cfg)
    assert experiment_model("x") == (mixer, head)
