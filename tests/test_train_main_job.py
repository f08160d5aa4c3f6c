"""`ssogvit main`: the side-by-side table, the curves and paths it reports, and (slow) the 90% claim."""

from __future__ import annotations

import re

import pytest

from ssogvit.train.curves import read_epoch_metrics
from ssogvit.train.main_job import main


def test_main_job_prints_table_and_paths_and_flags_a_short_run(tmp_path, capsys):
    out = tmp_path / "main"
    code = main(["--out", str(out), "--epochs", "1", "--no-progress", "trainer.limit_train_batches=2",
                 "trainer.limit_val_batches=1"])
    text = capsys.readouterr().out
    assert code == 1 and "NOT reached" in text  # two steps cannot reach 90%, and the job says so
    assert re.search(r"^vit-tiny-ssog\s+\d+\.\dk\s+\d+\.\d\d%", text, flags=re.M)
    assert re.search(r"^vit-tiny-mha\s+\d+\.\dk\s+\d+\.\d\d%", text, flags=re.M)
    for mixer in ("ssog", "mha"):
        assert (out / mixer / "checkpoints" / "last.ckpt").is_file()
        assert (out / mixer / "export" / "model.safetensors").is_file()
        assert str(out / mixer / "checkpoints") in text and str(out / mixer / "logs") in text
    # both models' curves, drawn from their CSV logs: one epoch each, the last validation top-1 as in the table
    assert f"training curves: {out / 'curves.png'}" in text
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ssog_top1 = float(re.search(r"^vit-tiny-ssog\s+\S+\s+(\d+\.\d\d)%", text, flags=re.M).group(1))
    curve = read_epoch_metrics(out / "ssog")["val/top1"]
    assert list(curve) == [0] and round(curve[0], 2) == ssog_top1
    # the same --out again: the finished runs stay as they are, the job writes to a fresh <out>-2
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    main(["--out", str(out), "--epochs", "1", "--no-progress", "--mixers", "ssog", "trainer.limit_train_batches=1",
          "trainer.limit_val_batches=1"])
    text = capsys.readouterr().out
    assert f"{out} holds another run; writing to {out}-2" in text
    assert (tmp_path / "main-2" / "ssog" / "export" / "model.safetensors").is_file()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == before


@pytest.mark.slow
def test_main_job_reaches_90_percent(tmp_path, capsys):
    code = main(["--out", str(tmp_path / "main"), "--no-progress"])
    text = capsys.readouterr().out
    print(text)
    top1 = float(re.search(r"^vit-tiny-ssog\s+\S+\s+(\d+\.\d\d)%", text, flags=re.M).group(1))
    assert code == 0 and top1 >= 90.0
