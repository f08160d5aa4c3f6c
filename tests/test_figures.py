"""Every figure the project writes reads as a paper's figure: no empty panel, no clipped title
(`ssogvit.results.figure_problems`, checked on each figure as it is saved), one metric per axis, an honest colour
scale, and an interval only where there are seeds to make one."""

from __future__ import annotations

import json

import matplotlib
import pytest
import torch
import yaml

from ssogvit.cli import main as cli_main
from ssogvit.results import figure_problems

matplotlib.use("Agg")


@pytest.fixture
def saved(monkeypatch):
    """`[(path, figure)]` of every figure saved during the test; each is checked by `figure_problems` first."""
    from matplotlib.figure import Figure

    seen, original = [], Figure.savefig

    def savefig(fig, fname, *args, **kwargs):
        problems = figure_problems(fig)
        assert not problems, f"{fname}: {problems}"
        seen.append((str(fname), fig))
        return original(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def test_the_check_finds_an_empty_panel_and_a_clipped_title():
    import matplotlib.pyplot as plt

    fig, (full, empty) = plt.subplots(1, 2, figsize=(3, 2))
    full.plot([0, 1], [0, 1])
    full.set_title("a title far too long for a figure three inches wide, cut off on both sides")
    problems = figure_problems(fig)
    plt.close(fig)
    assert len(problems) == 2 and "axes 1 ('untitled') is empty" in problems[0] and "is clipped" in problems[1]


def _run(folder, name: str, metric: str, values: list[float], *, task: str | None = None, seed: int = 0):
    """A run folder as `ssogvit train` leaves it, as far as `ssogvit report` reads it."""
    (folder / "logs" / "version_0").mkdir(parents=True)
    cfg = {"name": name, "seed": seed, "data": {"name": "digit_scenes" if task else "digits"},
           "trainer": {"max_epochs": len(values)}, "meta": {},
           "model": {"family": "vit", "mixer": "ssog", "kwargs": {"task": task}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = ["epoch,step,train/loss_epoch,val/loss," + metric]
    rows += [f"{e},{e + 1},{2 - 0.1 * e},{2.1 - 0.1 * e},{v}" for e, v in enumerate(values)]
    (folder / "logs" / "version_0" / "metrics.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_a_report_over_classification_and_segmentation_runs_gives_each_metric_its_axes(tmp_path, saved, capsys):
    digits = _run(tmp_path / "digits", "digits_vit_ssog", "val/top1", [40.0, 60.0, 80.0])
    scenes = _run(tmp_path / "scenes", "scenes_vit_ssog_with_a_long_experiment_name", "val/miou", [10.0, 20.0],
                  task="segmentation")
    assert cli_main(["report", str(digits), str(scenes), "--out", str(tmp_path / "out")]) == 0
    figures = {path.rsplit("/", 1)[-1]: fig for path, fig in saved}
    assert set(figures) == {"curves.png", "segmentation.png"}
    assert titles(figures["curves.png"]) == ["loss", "validation top-1", "validation mIoU"]
    top1, miou = figures["curves.png"].axes[1:]
    assert [ln.get_label() for ln in top1.get_lines()] == ["digits_vit_ssog"]
    assert [ln.get_label() for ln in miou.get_lines()] == ["scenes_vit_ssog_with_a_long_experiment_name"]
    table = (tmp_path / "out" / "segmentation.md").read_text()
    assert "20.00 (1 seed)" in table and "±" not in table.split("\n\n", 1)[1]  # one seed: no interval


def _tiny(name: str, depth: int = 2, **kw):
    from ssogvit.models import create_model

    torch.manual_seed(0)
    return create_model(name, img_size=16, patch_size=4, in_chans=1, num_classes=3, depth=depth, embed_dim=16,
                        num_heads=2, **kw).eval()


def test_the_analysis_figures_draw_only_what_was_measured_on_honest_scales(tmp_path, saved):
    from ssogvit.analysis.atoms import atoms_report, plot_atoms
    from ssogvit.analysis.fields import plot_query_fields
    from ssogvit.analysis.sinks import plot_sinks, sink_report

    images = torch.randn(4, 1, 16, 16)
    only_ssog = {m: sink_report(_tiny(f"vit-tiny-{m}"), images) for m in ("ssog", "ssog-steered")}
    plot_sinks(only_ssog, tmp_path / "sinks_ssog.png")  # CLS mass 0 for both: no panel for it
    fig = saved[-1][1]
    assert titles(fig) == ["sink score (1 = no sink)", "same-key share"]
    assert "CLS mass from patch queries: ssog 0 by construction" in fig._supxlabel.get_text()
    plot_sinks({**only_ssog, "mha": sink_report(_tiny("vit-tiny-mha"), images)}, tmp_path / "sinks.png")
    assert len(titles(saved[-1][1])) == 3

    models = {"ssog": _tiny("vit-tiny-ssog", num_atoms=4), "mha, deeper": _tiny("vit-tiny-mha", depth=3)}
    plot_atoms({"ssog": atoms_report(models["ssog"])}, tmp_path / "atoms.png")
    (image,) = saved[-1][1].axes[0].get_images()
    assert image.get_clim() == (1.0, 4.0)  # the quantity's range, 1 atom to R, whatever the values drawn
    plot_query_fields(models, images[0], tmp_path / "fields_query.png")  # rows of 2 and 3 panels: none left empty
    hidden = [ax for ax in saved[-1][1].axes if not ax.get_visible()]
    assert len(hidden) == 1


def test_analyze_fields_takes_a_segmentation_checkpoint(tmp_path, saved, capsys):
    """The issue's case: `ssogvit analyze fields` on a segmentation run's export was a TypeError; it draws the
    encoder's fields (every block trained: the pyramid reads the last one)."""
    from ssogvit.models import create_model
    from ssogvit.train.io import export_safetensors

    torch.manual_seed(0)
    model = create_model("vit-tiny-ssog", task="segmentation", num_classes=11, img_size=32, patch_size=4, in_chans=1,
                         depth=2, embed_dim=16, num_heads=2, pyramid_dim=8, head_dim=8)
    run = tmp_path / "run"
    path = export_safetensors(model, run / "export" / "model.safetensors")
    data = {"name": "digit_scenes", "num_classes": 11, "in_chans": 1, "img_size": 32, "num_train_scenes": 2,
            "num_val_scenes": 2, "aug": {"scale": None, "hflip": 0.0, "mean": [0.5], "std": [0.5]}}
    (run / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    assert cli_main(["analyze", "fields", "--ckpt", str(path), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "fields.json").read_text())["query"]["run"]
    assert summary["applications"] == [0, 1] and "untrained" not in " ".join(titles(saved[-1][1]))
    assert cli_main(["analyze", "transfer", "--ckpt", str(path), "--out", str(tmp_path / "out2")]) == 2
    assert "ssogvit eval --ckpt ... --img-size N" in capsys.readouterr().err


@pytest.mark.slow  # about 15 s: the default run checks the report and analysis figures above
def test_the_other_figures_pass_the_check_too(tmp_path, saved):
    """The rest of what `ssogvit analyze`, `main` and `report` draw, on tiny models and logs (each checked as saved):
    the training curves (a run without validation gets no empty panel), the atoms, Lipschitz, steering and transfer
    figures."""
    from ssogvit.analysis.fields import plot_fields
    from ssogvit.analysis.lipschitz import lipschitz_report, plot_lipschitz
    from ssogvit.analysis.steering import plot_steering, steering_stats
    from ssogvit.analysis.transfer import plot_transfer, transfer_table
    from ssogvit.train.curves import plot_training_curves

    runs = {"a": [_run(tmp_path / "a", "a", "val/top1", [50.0, 70.0])], "b": [tmp_path / "b"]}
    (tmp_path / "b" / "logs" / "version_0").mkdir(parents=True)
    (tmp_path / "b" / "logs" / "version_0" / "metrics.csv").write_text("epoch,step,train/loss_epoch\n0,1,2.0\n")
    plot_training_curves(runs, tmp_path / "curves.png", title="two runs")
    assert titles(saved[-1][1]) == ["training loss", "validation loss", "validation top-1 (%)"]
    (tmp_path / "a").rename(tmp_path / "gone")
    plot_training_curves({"b": [tmp_path / "b"]}, tmp_path / "curves_b.png")
    assert titles(saved[-1][1]) == ["training loss"]  # no validation logged: no empty validation panels

    steered = _tiny("vit-tiny-ssog-steered")
    fixed = _tiny("vit-tiny-ssog")
    images, labels = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 0])
    plot_fields(fixed, tmp_path / "fields_atoms.png", title="atoms")
    reports = {"ssog": lipschitz_report(fixed, iters=3, samples=1),
               "steered": lipschitz_report(steered, iters=3, samples=1, max_steered=1, radii=[1.0, 4.0])}
    plot_lipschitz(reports, tmp_path / "lipschitz.png")
    plot_steering(steering_stats(steered, images), tmp_path / "steering.png", title="steered")

    def images_at(size: int):
        return torch.nn.functional.interpolate(images, size=(size, size)), labels

    plot_transfer({"ssog": transfer_table(fixed, images_at, patch_sizes=[2, 4], img_sizes=[24])},
                  tmp_path / "transfer.png")
    names = [p.rsplit("/", 1)[-1].split(".")[1] for p, _ in saved]  # the temporary names of ssogvit.outputs
    assert names == ["curves", "curves_b", "fields_atoms", "lipschitz", "steering", "transfer"]
