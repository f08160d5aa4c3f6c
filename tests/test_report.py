"""`ssogvit report`: paper tables and curves from the logged metrics of finished runs, through the CLI."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli_process

from ssogvit.cli import main as cli
from ssogvit.train.config import compose, experiment_rows
from ssogvit.train.report import ReportError, read_run, table_markdown
from ssogvit.train.run import train

TINY = [
    "data=digits", "data.img_size=16", "model.size=tiny", "model.kwargs.patch_size=4", "model.kwargs.embed_dim=32",
    "model.kwargs.num_heads=2", "model.kwargs.depth=1", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu", "trainer.devices=1", "trainer.limit_train_batches=5", "trainer.log_every_n_steps=1",
    "resume=null",
]


def ssogvit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli_process.run(list(map(str, args)), env=env)


def val_top1_from_csv(run: Path) -> dict[int, float]:
    """Epoch (from 1) -> val/top1, read straight from the CSV log."""
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        return {int(r["epoch"]) + 1: float(r["val/top1"]) for r in csv.DictReader(f) if r.get("val/top1")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    paper = root / "ode_fixed"  # labelled as Table 1's fixed ODE-SSoG run, trained tiny on digits
    train(compose(["experiment=cifar100_ode_base_ssog", *TINY, f"output_dir={paper}"]), verbose=False)
    plain = root / "vit_digits"  # a run that reproduces no paper row
    train(compose(["model=vit", *TINY, f"output_dir={plain}"]), verbose=False)
    return root, paper, plain


def test_report_writes_the_table_beside_the_papers_numbers_and_the_curves(runs):
    root, paper, plain = runs
    out = root / "out"
    p = ssogvit("report", paper, plain, "--out", out)
    assert p.returncode == 0, p.stderr
    top1 = val_top1_from_csv(paper)
    assert len(top1) == 2
    best_epoch = max(top1, key=lambda e: (top1[e], -e))
    fixed = next(ln for ln in (out / "table1.md").read_text().splitlines() if ln.startswith("| Fixed |"))
    cells = [c.strip() for c in fixed.strip("|").split("|")]
    assert cells == ["Fixed", "cifar100_ode_base_ssog", "74.22", f"{top1[best_epoch]:.2f} ({best_epoch})",
                     f"{top1[2]:.2f}", "digits", "2/2"]
    assert "| Full, cold | cifar100_ode_base_ssog_steered | 70.89 | not run |" in (out / "table1.md").read_text()
    for t in (6, 7, 10, 11, 15):  # every table the run belongs to
        assert "cifar100_ode_base_ssog | 74.22 |" in (out / f"table{t}.md").read_text()
    plain_top1 = val_top1_from_csv(plain)
    row = next(ln for ln in (out / "runs.md").read_text().splitlines() if ln.startswith("| vit-tiny-ssog_digits |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # each run by its folder and seed (audit D098)
    assert cells[1:4] == [plain.name, "42", f"{max(plain_top1.values()):.2f} ({cells[3].split('(')[1]}"], cells
    assert float(cells[-1]) >= 0  # its final weights' test top-1: the digits have a test split
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_every_accuracy_column_of_the_report_names_its_split(runs):
    """The audit's B64b: runs.md's "final" column, the final epoch's validation top-1 of the raw weights, stood
    unlabelled (beside test figures elsewhere in the report): every figure's column says which split it is of."""
    root, paper, plain = runs
    out = root / "labels"
    assert ssogvit("report", paper, plain, "--out", out).returncode == 0
    tables = sorted(out.glob("*.md"))
    assert {"runs.md", "table1.md"} <= {t.name for t in tables}
    for table in tables:
        lines = table.read_text().splitlines()
        headers = [lines[i] for i in range(len(lines) - 1) if lines[i + 1].startswith("|---")]
        cells = [c.strip() for h in headers for c in h.strip("|").split("|")]
        scores = [c for c in cells if any(w in c for w in ("Acc@1", "top-1", "mIoU", "accuracy"))]
        assert scores and all(any(w in c for w in ("Paper", "val", "test")) for c in scores), (table.name, scores)
    assert "validation top-1 (%) of the raw weights (not EMA)" in (out / "runs.md").read_text().splitlines()[0]


def test_report_never_overwrites_unless_forced(runs, capsys):
    root, paper, _ = runs
    out = root / "again"
    assert cli(["report", str(paper), "--table", "1", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "table1.md"]
    (out / "table1.md").write_text("mine")
    assert cli(["report", str(paper), "--table", "1", "--out", str(out)]) == 2
    assert "already exist" in capsys.readouterr().err
    assert (out / "table1.md").read_text() == "mine"
    assert cli(["report", str(paper), "--table", "1", "--out", str(out), "--overwrite"]) == 0
    assert "| Fixed |" in (out / "table1.md").read_text()


def test_report_refuses_bad_input_with_exit_2(runs, tmp_path, capsys):
    root, paper, plain = runs
    p = ssogvit("report", tmp_path / "nowhere", "--out", tmp_path / "o")
    assert p.returncode == 2 and "nowhere does not exist" in p.stderr and "Traceback" not in p.stderr
    assert cli(["report", str(plain), "--table", "1", "--out", str(tmp_path / "o")]) == 2
    assert "reproduce no row of Table 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_resumed_runs_take_the_later_launch_for_an_epoch(runs, tmp_path):
    _, paper, _ = runs
    run = tmp_path / "resumed"
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_1").mkdir(parents=True)
    (run / "config.yaml").write_text((paper / "config.yaml").read_text())
    head = "epoch,step,train/loss_epoch,val/loss,val/top1\n"
    (run / "logs" / "version_0" / "metrics.csv").write_text(head + "0,5,,2.0,10.0\n0,5,2.1,,\n1,9,,1.9,20.0\n")
    (run / "logs" / "version_1" / "metrics.csv").write_text(head + "1,9,,1.8,25.0\n2,13,,1.7,30.0\n")
    log = read_run(run)
    assert log.series["val/top1"] == {1: 10.0, 2: 25.0, 3: 30.0}
    log.rows = [{"table": 1, "row": "Renamed row", "top1": 74.22}]  # a row the current configs do not have
    assert "| Renamed row (not in the current configs) | cifar100_ode_base_ssog | 74.22 | 30.00 (3) | 30.00 |" in (
        table_markdown(1, experiment_rows(1), [log]))
    assert log.series["train/loss_epoch"] == {1: 2.1}
    assert log.best_top1() == (30.0, 3) and log.final_top1() == 30.0
    (run / "logs" / "version_1" / "metrics.csv").unlink()
    (run / "logs" / "version_0" / "metrics.csv").write_text(head + "0,5,2.1,,\n")
    with pytest.raises(ReportError, match="no epoch of the run has finished"):
        read_run(run)


def test_report_reads_the_test_split_and_writes_a_sweep_table_apart_from_comparisons(runs, tmp_path):
    root, paper, plain = runs
    log = read_run(plain)
    with open(plain / "logs" / "version_0" / "metrics.csv") as f:
        tested = [float(r["test/top1"]) for r in csv.DictReader(f) if r.get("test/top1")]
    assert len(tested) == 1 and log.test_top1 == tested[0]  # the final weights on the held-out digits, once
    other = root / "vit_digits_lr"  # the same run at another learning rate: together they are a sweep
    train(compose(["model=vit", *TINY, "optim.lr=1e-3", f"output_dir={other}"]), verbose=False)
    p = ssogvit("report", plain, other, "--out", tmp_path / "out")
    assert p.returncode == 0, p.stderr
    sweep = (tmp_path / "out" / "sweep.md").read_text()
    rows = [ln for ln in sweep.splitlines() if ln.startswith("| vit-tiny-ssog_digits |")]
    assert len(rows) == 2 and sum("**chosen**" in r for r in rows) == 1
    assert {r.split("|")[3].strip() for r in rows} == {"optim.lr=0.001", "optim.lr=0.002"}  # only what varies
    finals = {r.split("|")[3].strip(): float(r.split("|")[4].split()[0]) for r in rows}
    chosen = next(r.split("|")[3].strip() for r in rows if "**chosen**" in r)
    assert finals[chosen] == max(finals.values())  # the best final validation top-1


def test_a_comparison_never_averages_two_different_models_as_seeds(runs):
    """Runs of depth 4 and depth 2 (seeds 42 and 1) were averaged as two seeds of one model."""
    from ssogvit.train.report import ReportError, models_markdown

    _, _, plain = runs
    a, b = read_run(plain), read_run(plain)
    b.seed = a.seed + 1
    assert f"| {a.family} | {a.head} | {a.mixer} |" in models_markdown([a, b])  # two seeds of one model
    b.model = {**b.model, "kwargs": {**b.model["kwargs"], "depth": 7}}
    with pytest.raises(ReportError, match=r"two different models of vit ssog \(token head\): model.kwargs.depth: "
                                          r"vit_digits 1, vit_digits 7; a comparison averages the seeds of one model"):
        models_markdown([a, b])
    b.model = {**a.model, "kwargs": {k: v for k, v in a.model["kwargs"].items() if k != "global_pool"}}
    assert a.head == "token" and b.model != a.model  # the head left to its default, or said: one model
    assert f"| {a.family} | {a.head} | {a.mixer} |" in models_markdown([a, b])


def test_a_run_that_leaves_its_head_to_the_model_is_labelled_with_the_head_the_model_built():
    """`global_pool: null` builds the mixer's own head (mean-pooled for SSoG): the report called it 'token'."""
    from ssogvit.train.report import _head

    assert _head({"mixer": "ssog", "kwargs": {"global_pool": None}}) == "avg"
    assert _head({"mixer": "mha", "kwargs": {}}) == "token"
    assert _head({"mixer": "ssog", "kwargs": {"global_pool": "token"}}) == "token"



def test_a_comparison_refuses_runs_of_another_data_split_or_budget(tmp_path):
    """The audit's C086 and C056: an SSoG run and its MHA twin of another data.split_seed (different test sets) or
    another trainer.max_epochs were paired as seeds of one comparison; only what `comparison.MAY_DIFFER` declares
    may differ."""
    import shutil

    import yaml

    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
             "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "trainer.devices=1", "resume=null"]
    paper, twin = tmp_path / "vit_ssog", tmp_path / "vit_mha"  # CPU-sized twins of the paper's runs
    for experiment, out in (("digits8_vit_ssog", paper), ("digits8_vit_mha", twin)):
        train(compose([f"experiment={experiment}", *short, f"output_dir={out}"]), verbose=False)
    p = ssogvit("report", paper, twin, "--out", tmp_path / "out")
    assert p.returncode == 0, p.stderr
    assert "| ssog - mha |" in (tmp_path / "out" / "reproduction.md").read_text()
    for key in ("data.split_seed", "trainer.max_epochs"):
        other = tmp_path / key
        shutil.copytree(twin, other)
        config = yaml.safe_load((other / "config.yaml").read_text())
        section, name = key.split(".")
        saved = config[section][name]
        value = config[section][name] = saved + 1
        (other / "config.yaml").write_text(yaml.safe_dump(config))
        if section == "data":  # the fifth audit's E270: config.yaml is checked against the run's sealed export
            p = ssogvit("report", paper, other, "--out", tmp_path / f"out-{key}")
            assert p.returncode == 2 and f"config.yaml was changed since {other / 'export'}" in p.stderr, p.stderr
        shutil.rmtree(other / "export")  # a run with no sealed record: its logs and config.yaml are all there is
        shutil.rmtree(other / "checkpoints")
        p = ssogvit("report", paper, other, "--out", tmp_path / f"out-{key}")
        assert p.returncode == 2 and p.stderr.splitlines() == [
            f"ssogvit report: {paper} and {other} cannot be compared: {key}: {paper.name} {saved!r}, {other.name} "
            f"{value!r}; the runs of a comparison differ only in the mixer, its head and its tuned settings "
            "(docs/training.md, \"How comparisons are made\"): report them apart"], p.stderr
        assert not (tmp_path / f"out-{key}").exists()
    # one comparison per family: a looped twin reports beside the discrete ones (the families differ in the model
    # only), and one of another data split is refused as the discrete twin was
    looped = tmp_path / "looped_mha"
    train(compose(["experiment=digits8_looped_mha", *short, f"output_dir={looped}"]), verbose=False)
    p = ssogvit("report", paper, twin, looped, "--out", tmp_path / "families")
    assert p.returncode == 0, p.stderr
    other = tmp_path / "looped_split"
    shutil.copytree(looped, other)
    config = yaml.safe_load((other / "config.yaml").read_text())
    config["data"]["split_seed"] += 1
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.rmtree(other / "export")  # no sealed record, as above
    shutil.rmtree(other / "checkpoints")
    p = ssogvit("report", paper, twin, other, "--out", tmp_path / "families-split")
    assert p.returncode == 2 and "cannot be compared: data.split_seed" in p.stderr, p.stderr


def test_a_report_never_stands_beside_an_earlier_reports_files(runs, tmp_path):
    """The audit's C132: `report --overwrite` into a folder holding an earlier report's table7.md left it beside the
    new files, as if part of this report; the user's own files are no report's."""
    _, _, plain = runs
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "table7.md").write_text("old table7")
    p = ssogvit("report", plain, "--out", out, "--overwrite")
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"ssogvit report: {out} holds table7.md of an earlier report, which this one does not write: the folder "
        "would mix two reports; move them away or choose another --out"], p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["notes.txt", "table7.md"]
    (out / "table7.md").unlink()
    assert ssogvit("report", plain, "--out", out).returncode == 0
    assert sorted(x.name for x in out.iterdir()) == ["curves.png", "notes.txt", "runs.md"]
