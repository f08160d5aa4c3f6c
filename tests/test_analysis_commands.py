"""Every `ssogvit analyze` command runs on models trained a few steps on digits and writes a non-empty picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ssogvit.analysis import _data
from ssogvit.analysis.cli import main as analyze_main
from ssogvit.cli import main as ssogvit_main
from ssogvit.models import create_model
from ssogvit.train.io import export_safetensors

SMALL = dict(img_size=32, patch_size=4, in_chans=1, num_classes=10, depth=2, embed_dim=48, num_heads=3)


def _digits_train_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits training split at 32 px, normalised as the packaged config does ((x - 0.5) / 0.5)."""
    from ssogvit.data import load_digits_split

    images, labels = load_digits_split()["train"]
    x = torch.from_numpy(images).float().div(255.0).unsqueeze(1)  # (n, 1, 8, 8)
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False)
    return (x - 0.5) / 0.5, torch.from_numpy(labels)


def _train_few_steps(name: str, data, steps: int, **options) -> torch.nn.Module:
    """AdamW on the digits training split, a few steps of batch 32. (A few steps do not make a good classifier, and
    the tests do not ask for one: they ask that every command runs on trained weights.)"""
    torch.manual_seed(0)
    model = create_model(name, **SMALL, **options)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(x), (32,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in after if k.endswith((".mu", ".v.weight", "qkv.weight")))
    return model.eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    data = _digits_train_tensors()
    out = {}
    for label, name, steps, options in (
        ("ssog", "vit-tiny-ssog", 10, {}),
        ("mha", "vit-tiny-mha", 10, {}),
        ("steered", "vit-tiny-ssog-steered", 6, {"gate_init": -2.0}),
    ):
        model = _train_few_steps(name, data, steps, **options)
        out[label] = export_safetensors(model, root / label / "export" / "model.safetensors")
    return out


def _assert_picture(path: str | Path) -> None:
    import matplotlib.image as mpimg

    path = Path(path)
    assert path.is_file() and path.stat().st_size > 5_000, path
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
    assert pixels[..., :3].std() > 0.02  # not a blank canvas


def _run(what: str, ckpts: dict[str, Path], labels: list[str], out: Path, *extra: str) -> dict:
    argv = [what, "--out", str(out), "--num-images", "12", "--transfer-images", "48", *extra]
    for label in labels:
        argv += ["--ckpt", str(ckpts[label])]
    assert analyze_main(argv) == 0
    return json.loads((out / f"{what}.json").read_text())


def test_fields_draws_atoms_and_the_query_field_for_ssog_and_mha(ckpts, tmp_path):
    data = _run("fields", ckpts, ["ssog", "mha"], tmp_path, "--query", "3,4")
    _assert_picture(tmp_path / "fields_atoms.png")  # only the SSoG model has atoms
    _assert_picture(tmp_path / "fields_query.png")
    assert set(data["query"]) == {"ssog", "mha"}
    assert data["query"]["ssog"]["query"] == [3, 4]
    for label in ("ssog", "mha"):
        assert all(0.0 <= m <= 1.0 + 1e-6 for m in data["query"][label]["local_3x3"])
    assert (tmp_path / "fields.md").read_text().count("| ssog |") == 2  # one row per block


def test_fields_refuses_a_query_outside_the_grid_in_one_line_before_drawing(ckpts, tmp_path, capsys):
    argv = ["fields", "--out", str(tmp_path / "out"), "--num-images", "12", "--query", "99,99",
            "--ckpt", str(ckpts["ssog"])]
    assert analyze_main(argv) == 2
    err = capsys.readouterr().err
    assert "--query 99,99: outside the" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.*"))
    # a label for no model was dropped without a word
    assert analyze_main(["atoms", "--out", str(tmp_path / "out"), "--ckpt", str(ckpts["ssog"]), "--label", "a",
                         "--label", "b"]) == 2
    assert "2 --label for 1 model(s): give at most one per --ckpt/--model" in capsys.readouterr().err


def test_atoms_reports_effective_atoms_between_1_and_r(ckpts, tmp_path):
    data = _run("atoms", ckpts, ["ssog"], tmp_path)
    _assert_picture(tmp_path / "atoms.png")
    rep = data["ssog"]
    assert len(rep["layers"]) == 2 and all(len(r["per_head"]) == 3 for r in rep["layers"])
    assert all(1.0 - 1e-9 <= v <= rep["num_atoms"] + 1e-9 for r in rep["layers"] for v in r["per_head"])


def test_lipschitz_estimates_stay_below_the_bound_on_a_trained_model(ckpts, tmp_path):
    data = _run("lipschitz", ckpts, ["ssog", "steered"], tmp_path, "--radii", "0.5,4", "--iters", "25",
                "--samples", "1", "--max-steered", "1")
    _assert_picture(tmp_path / "lipschitz.png")
    fixed = data["ssog"]["fixed"]
    assert len(fixed) == 2 and all(0 < r["estimate"] <= r["bound"] * (1 + 1e-9) for r in fixed)
    assert data["ssog"]["num_prefix_tokens"] == 1 and data["ssog"]["grid"] == [8, 8]
    steered = data["steered"]["steered"]
    assert len(steered) == 1
    assert [g["radius"] for g in steered[0]["growth"]] == pytest.approx([0.5 * 48**0.5, 4 * 48**0.5])


def test_sinks_table_puts_ssog_and_mha_side_by_side(ckpts, tmp_path):
    data = _run("sinks", ckpts, ["ssog", "mha"], tmp_path)
    _assert_picture(tmp_path / "sinks.png")
    ssog, mha = data["ssog"], data["mha"]
    assert ssog["num_images"] == mha["num_images"] == 12
    assert ssog["cls_mass"] == 0.0  # SSoG patches never attend to prefix tokens
    assert mha["cls_mass"] > 0.0
    for s in (ssog, mha):
        assert s["sink_worst"] >= s["sink_mean"] >= 1.0 - 1e-9  # a row-stochastic map's largest column sum is >= 1
        assert 0.0 <= s["high_norm"] <= 1.0 and 0.0 < s["same_key"] <= 1.0
    md = (tmp_path / "sinks.md").read_text()
    assert "| ssog |" in md and "| mha |" in md


def test_steering_reports_gates_shifts_and_radius(ckpts, tmp_path):
    data = _run("steering", ckpts, ["steered"], tmp_path)
    _assert_picture(tmp_path / "steering.png")
    rows = data["steered"]["mixers"]
    assert len(rows) == 2
    for r in rows:
        assert set(r["gates"]) == {"mu", "sigma", "lambda"}
        assert r["effective_radius"] == pytest.approx(r["gates"]["mu"] * r["radius"])
        assert 0.0 <= r["mean_delta_mu"] <= r["max_delta_mu"] <= r["effective_radius"] * (1 + 1e-6)
    # trained steering moves the centres in block 0. (In the last block it cannot have learned anything: the head reads
    # the class token, whose mixer output is the mean patch value, so no gradient reaches that block's field.)
    assert rows[0]["mean_delta_mu"] > 0.0


def test_transfer_evaluates_other_patch_and_image_sizes_with_and_without_rescaling(ckpts, tmp_path):
    data = _run("transfer", ckpts, ["ssog"], tmp_path, "--patch-sizes", "4,2,8", "--img-sizes", "24")
    _assert_picture(tmp_path / "transfer.png")
    rows = data["ssog"]
    got = {(r["kind"], r["patch"], r["img_size"], r["rescale"]) for r in rows}
    assert got == {("trained", 4, 32, False), ("patch", 2, 32, False), ("patch", 2, 32, True),
                   ("patch", 8, 32, False), ("patch", 8, 32, True), ("image", 4, 24, False), ("image", 4, 24, True)}
    assert all(0.0 <= r["top1"] <= 1.0 for r in rows)
    # the training setting reproduces the model's own accuracy on the same images
    from ssogvit.analysis import accuracy
    from ssogvit.train.io import load_model

    x, y = _data.validation_set(_data.data_config("digits"), limit=48)
    trained = next(r for r in rows if r["kind"] == "trained")
    assert trained["top1"] == pytest.approx(accuracy(load_model(ckpts["ssog"]), x, y))


def test_analyze_runs_on_a_fresh_model_through_the_ssogvit_command(tmp_path, capsys):
    rc = ssogvit_main(["analyze", "atoms", "--model", "vit-tiny-ssog", "--model-kw", "depth=1", "--out", str(tmp_path)])
    assert rc == 0
    assert "atoms  vit-tiny-ssog: mean 4.000 of R=4" in capsys.readouterr().out  # fresh: ell = 0, uniform lambda
    _assert_picture(tmp_path / "atoms.png")
