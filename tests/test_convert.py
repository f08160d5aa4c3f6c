"""Conversion of an attention ViT into an SSoG ViT: the field fit, the student, the recipes and `ssogvit convert`."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import timm
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cli_process

from ssogvit import SSoGAttention, create_model
from ssogvit.convert import (
    ConversionModule,
    attention_probs,
    build_student,
    fit_fields,
    fit_mixer,
    format_report,
    load_converted,
    plot_fit,
)
from ssogvit.convert.fit import _kl_rows
from ssogvit.timm_compat import TimmSSoGAttention
from ssogvit.train.io import CheckpointError, export_safetensors, load_model


def tiny_teacher(**kw) -> nn.Module:
    """An MHA ViT of ours on 16 px grayscale digits, patch 4: a 4x4 grid."""
    options = {"embed_dim": 16, "num_heads": 2, "depth": 2, "img_size": 16, "patch_size": 4, "in_chans": 1,
               "num_classes": 10}
    return create_model("vit-tiny-mha", **{**options, **kw}).eval()


@torch.no_grad()
def patch_matrix(mixer: SSoGAttention, grid, prefix: int = 1) -> torch.Tensor:
    x = torch.zeros(1, prefix + grid[0] * grid[1], mixer.dim, dtype=torch.float64)
    return mixer.attention_matrix(x, grid)[:, :, prefix:, prefix:]


# -- the fit ---------------------------------------------------------------------------------------------------------

def test_fit_recovers_a_known_field():
    grid = (5, 6)
    known = SSoGAttention(8, 2, num_atoms=2).double()
    with torch.no_grad():
        known.mu.copy_(torch.tensor([[[1.0, -2.0], [-1.5, 0.5]], [[0.0, 1.0], [2.0, 2.0]]]))
        known.rho.copy_(torch.tensor([[[-1.0, 0.0], [0.5, -0.5]], [[0.0, 0.0], [-1.0, 1.0]]]))
        known.ell.copy_(torch.tensor([[0.5, -0.5], [0.0, 1.0]]))
    target = patch_matrix(known, grid)  # (1, H, N, N): an SSoG head's own matrix as the teacher attention
    student = SSoGAttention(8, 2, num_atoms=2).double()  # another random start
    start = float(_kl_rows(target, patch_matrix(student, grid)).mean())
    x = torch.zeros(1, 1 + 30, 8, dtype=torch.float64)
    losses = fit_mixer(student, x, target, grid, steps=400, lr=0.1)
    fitted = patch_matrix(student, grid)
    final = float(_kl_rows(target, fitted).mean())
    assert start > 0.1
    assert final < 1e-3, (start, final)
    assert losses[-1] == pytest.approx(final, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(fitted, target, atol=2e-2, rtol=0)


def test_attention_probs_reproduce_the_teacher_attention():
    teacher = tiny_teacher()
    attn = teacher.blocks[0].attn
    x = torch.randn(3, 17, 16)
    probs = attention_probs(attn, x)  # (B, H, T, T)
    v = attn.qkv(x)[..., 32:].view(3, 17, 2, 8).transpose(1, 2)
    out = attn.proj((probs @ v).transpose(1, 2).reshape(3, 17, 16))
    torch.testing.assert_close(out, attn(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2, 17))


def test_fit_report_and_picture(tmp_path):
    teacher = tiny_teacher()
    student = build_student(teacher)
    images = torch.randn(6, 1, 16, 16)
    before = copy.deepcopy(student.state_dict())
    fit = fit_fields(teacher, student, images, steps=30)
    assert [(r["block"], r["head"]) for r in fit.rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in fit.rows:
        assert r["kl"] >= 0 and r["kl_uniform"] >= 0 and r["kl_content"] >= 0
        assert r["explained"] <= 1.0 and 0.0 <= r["prefix_mass"] <= 1.0
        assert r["kl_content"] <= r["kl"] + 1e-9  # no fixed field beats the mean row of the images
    # only the fields moved: values, projections, MLPs are the teacher's
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.rsplit(".", 1)[-1] in ("mu", "rho", "ell", "theta") for k in changed)
    report = format_report(fit)
    assert "| 1 | 1 |" in report and "explained" in report
    png = plot_fit(fit, tmp_path / "fields.png", heads=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the student -----------------------------------------------------------------------------------------------------

def test_student_keeps_the_teachers_input_size_classes_and_prefix_tokens():
    teacher = tiny_teacher(num_registers=2, num_classes=7)
    student = build_student(teacher, mixer="ssog-steered", num_atoms=3)
    assert student.config["name"] == "vit-tiny-ssog-steered"
    for key in ("img_size", "patch_size", "num_classes", "num_prefix_tokens", "embed_dim", "depth", "in_chans"):
        assert getattr(student, key) == getattr(teacher, key), key
    assert student.grid_size == teacher.grid_size
    for tb, sb in zip(teacher.blocks, student.blocks):
        torch.testing.assert_close(sb.attn.v.weight, tb.attn.qkv.weight[32:], atol=0, rtol=0)
        torch.testing.assert_close(sb.attn.proj.weight, tb.attn.proj.weight, atol=0, rtol=0)
        torch.testing.assert_close(sb.mlp.fc1.weight, tb.mlp.fc1.weight, atol=0, rtol=0)
        assert sb.attn.num_atoms == 3 and sb.attn.steer == ("mu", "sigma", "lambda")
    assert student(torch.randn(2, 1, 16, 16)).shape == (2, 7)


def test_timm_teacher_gives_a_timm_student_that_reloads(tmp_path):
    kwargs = {"num_classes": 5, "img_size": 16, "patch_size": 4, "embed_dim": 16, "num_heads": 2, "depth": 2,
              "reg_tokens": 1}
    teacher = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs).eval()
    teacher.config_timm = {"timm_model": "vit_tiny_patch16_224", "timm_kwargs": kwargs}
    student = build_student(teacher).eval()
    assert all(isinstance(b.attn, TimmSSoGAttention) for b in student.blocks)
    assert student.num_prefix_tokens == teacher.num_prefix_tokens == 2
    fit_fields(teacher, student, torch.randn(4, 3, 16, 16), steps=10)
    x = torch.randn(2, 3, 16, 16)
    student.config = student.config_timm
    path = export_safetensors(student, tmp_path / "model.safetensors")
    again = load_converted(path)
    torch.testing.assert_close(again(x), student(x), atol=0, rtol=0)
    side = path.with_suffix(".json")  # the recipe comes from the seal; an edit of the copy beside it is refused
    meta = json.loads(side.read_text())
    meta["model_config"]["mixer_options"]["sigma_min"] = 0.9
    side.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"model.json does not match .*model_config\.mixer_options\.sigma_min"):
        load_converted(path)


def test_bad_teachers_and_options_are_refused():
    with pytest.raises(ValueError, match="not a Vision Transformer"):
        build_student(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()))
    with pytest.raises(ValueError, match="already mixes with SSoG"):
        build_student(create_model("vit-tiny-ssog", embed_dim=16, num_heads=2, depth=1, img_size=16, patch_size=4))
    with pytest.raises(ValueError, match=r"keeps the teacher's architecture.*embed_dim.*16"):
        build_student(tiny_teacher(), embed_dim=32)
    with pytest.raises(ValueError, match=r"calibration images are \(32, 32\) px.*\(16, 16\)"):
        fit_fields(tiny_teacher(), build_student(tiny_teacher()), torch.randn(2, 1, 32, 32), steps=1)


# -- the recipes -----------------------------------------------------------------------------------------------------

def _fit_module(recipe: str, steps: int, **distill):
    import lightning.pytorch as pl

    teacher = tiny_teacher()
    student = build_student(teacher)
    teacher_state = copy.deepcopy(teacher.state_dict())
    start = copy.deepcopy(student.state_dict())
    module = ConversionModule(
        student, teacher,
        recipe={"optim": {"lr": 1e-2, "weight_decay": 0.05}, "sched": {}, "batch_size": 8, "smoothing": 0.0},
        distill={"recipe": recipe, "temperature": 1.0, "kd_weight": 1.0, "feature_weight": 1.0,
                 "steps_per_block": 2, **distill},
    )
    data = DataLoader(TensorDataset(torch.randn(32, 1, 16, 16), torch.randint(0, 10, (32,))), batch_size=8)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data)
    assert all(torch.equal(v, teacher_state[k]) for k, v in teacher.state_dict().items()), "the teacher changed"
    changed = {k.split(".")[0] + ("." + k.split(".")[1] if k.startswith("blocks") else "")
               for k, v in student.state_dict().items() if not torch.equal(v, start[k])}
    return changed


def test_progressive_trains_one_block_at_a_time_then_all():
    assert _fit_module("progressive", 2) == {"blocks.0"}
    assert _fit_module("progressive", 4) == {"blocks.0", "blocks.1"}
    assert {"patch_embed", "head", "blocks.0", "blocks.1"} <= _fit_module("progressive", 6)


@pytest.mark.parametrize("recipe", ["logits", "blocks"])
def test_logit_and_block_recipes_train_every_part(recipe):
    assert {"patch_embed", "head", "blocks.0", "blocks.1"} <= _fit_module(recipe, 2)


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown conversion recipe 'fast'"):
        ConversionModule(build_student(tiny_teacher()), tiny_teacher(), recipe={}, distill={"recipe": "fast"})


# -- `ssogvit convert` end to end ------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli_process.run(["convert", *args], env=env, timeout=600)


TINY = ["data.img_size=16", "data.batch_size=16", "data.num_workers=0", "trainer.max_epochs=1",
        "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false", "convert.fit_steps=5", "convert.calib_images=8"]


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "model.safetensors"
    return export_safetensors(tiny_teacher(), path)


def test_convert_cli_end_to_end(teacher_file, tmp_path):
    out = tmp_path / "run"
    res = _cli("--teacher", str(teacher_file), "--out", str(out), *TINY)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("config.yaml", "fit/report.md", "fit/report.json", "fit/fields.png", "checkpoints/last.ckpt",
                 "export/model.safetensors"):
        assert (out / name).is_file(), name
    student = load_model(out / "export" / "model.safetensors")
    assert student.config["name"] == "vit-tiny-ssog"
    assert all(isinstance(m, SSoGAttention) for m in student.mixers())
    from_ckpt = load_model(out / "checkpoints" / "last.ckpt")
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(from_ckpt(x), student(x), atol=0, rtol=0)


@pytest.mark.slow
def test_convert_cli_resumes(teacher_file, tmp_path):
    out = tmp_path / "run"
    assert _cli("--teacher", str(teacher_file), "--out", str(out), *TINY).returncode == 0
    fit_report = (out / "fit" / "report.md").read_text()
    # the same folder again resumes from last.ckpt (one more epoch) instead of starting over
    res = _cli("--teacher", str(teacher_file), "--out", str(out), *TINY[:3], "trainer.max_epochs=2", *TINY[4:])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stdout and str(out / "checkpoints" / "last.ckpt") in res.stdout
    assert (out / "fit" / "report.md").read_text() == fit_report  # the fit is not redone over the resumed fields
    assert len(list((out / "logs").glob("version_*"))) == 2


def test_convert_cli_bad_input(teacher_file, tmp_path):
    empty = tmp_path / "calib"
    empty.mkdir()
    res = _cli("--teacher", str(teacher_file), "--out", str(tmp_path / "a"), "--calib", str(empty), *TINY)
    assert res.returncode == 2 and "holds no images" in res.stderr and "Traceback" not in res.stderr


def _config(teacher, out, *overrides):
    from omegaconf import OmegaConf

    from ssogvit.train.config import compose

    cfg = compose([*TINY, *overrides], config_name="convert")
    OmegaConf.update(cfg, "convert.teacher", str(teacher))
    OmegaConf.update(cfg, "output_dir", str(out))
    return cfg


def test_convert_refuses_bad_input(teacher_file, tmp_path):
    from ssogvit.convert import convert
    from ssogvit.train.io import CheckpointError

    with pytest.raises(ValueError, match=r"teacher's grid is 4x4.*give 8x8.*data.img_size=16"):
        convert(_config(teacher_file, tmp_path / "b", "data.img_size=32"))
    with pytest.raises(CheckpointError, match="does not exist"):
        convert(_config(tmp_path / "missing.safetensors", tmp_path / "c"))
    with pytest.raises(ValueError, match="convert.recipe='fast': expected one of 'logits'"):
        convert(_config(teacher_file, tmp_path / "d", "convert.recipe=fast"))
    kept = tmp_path / "kept"  # a finished training run, and a file of the user's
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "config.yaml").write_text("seed: 1\n")
    (kept / "run.json").write_text('{"status": "finished", "command": "train"}')
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    with pytest.raises(ValueError, match="holds a run of `ssogvit train`, not of `ssogvit convert`"):
        convert(_config(teacher_file, kept))
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before  # not even a lock file


def test_steered_fit_moves_the_steering_maps():
    teacher = tiny_teacher()
    student = build_student(teacher, mixer="ssog-steered", gate_init=-2.0)
    before = copy.deepcopy(student.state_dict())
    fit = fit_fields(teacher, student, torch.randn(3, 1, 16, 16), steps=5)
    assert all(torch.isfinite(torch.tensor(r["kl"])) and r["kl"] >= 0 for r in fit.rows)
    for i in range(2):
        for name in ("mu_steer.weight", "sigma_steer.weight", "lambda_steer.weight", "alpha_mu", "mu"):
            key = f"blocks.{i}.attn.{name}"
            assert not torch.equal(student.state_dict()[key], before[key]), key


def test_fields_train_at_their_own_learning_rate_without_weight_decay():
    student = build_student(tiny_teacher())
    module = ConversionModule(student, tiny_teacher(), recipe={}, distill={"recipe": "blocks", "field_lr_scale": 30})
    decay, no_decay, fields = module._param_groups(1e-3, 0.05)
    names = {id(p): n for n, p in student.named_parameters()}
    assert fields["lr"] == pytest.approx(3e-2) and fields["weight_decay"] == 0.0
    assert sorted({names[id(p)].rsplit(".", 1)[-1] for p in fields["params"]}) == ["ell", "mu", "rho", "theta"]
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.05
    assert len(decay["params"]) + len(no_decay["params"]) + len(fields["params"]) == len(names)


@pytest.mark.parametrize("family", ["looped", "ode"])
def test_looped_and_ode_teachers_convert_to_their_own_family(family):
    """One shared block: converted once, its field fitted to all its calls, and the recipes that apply train it."""
    teacher = create_model(f"{family}-tiny-mha", embed_dim=16, num_heads=2, depth=2, img_size=16, patch_size=4,
                           in_chans=1, num_classes=10).eval()
    student = build_student(teacher)
    assert student.config["name"] == f"{family}-tiny-ssog" and student.depth == teacher.depth
    block, teacher_block = student.blocks.block, teacher.blocks.block
    torch.testing.assert_close(block.attn.v.weight, teacher_block.attn.qkv.weight[32:], atol=0, rtol=0)
    before = block.attn.mu.detach().clone()
    fit = fit_fields(teacher, student, torch.randn(4, 1, 16, 16), steps=3)
    assert {row["block"] for row in fit.rows} == {0} and not torch.equal(before, block.attn.mu)
    module = ConversionModule(
        student, teacher, recipe={"optim": {"lr": 1e-2, "weight_decay": 0.05}, "sched": {}, "batch_size": 8,
                                  "smoothing": 0.0},
        distill={"recipe": "blocks", "temperature": 1.0, "kd_weight": 1.0, "feature_weight": 1.0},
    )
    import lightning.pytorch as pl

    start = copy.deepcopy(student.state_dict())
    data = DataLoader(TensorDataset(torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))), batch_size=8)
    pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0).fit(module, train_dataloaders=data)
    assert not torch.equal(start["blocks.0.attn.mu"], student.state_dict()["blocks.0.attn.mu"])
    with pytest.raises(ValueError, match="progressive replacement needs a discrete ViT"):
        ConversionModule(student, teacher, recipe={}, distill={"recipe": "progressive"})


@pytest.mark.slow
def test_convert_takes_hydra_forms_and_paths_with_equals_signs(teacher_file, tmp_path):
    odd = tmp_path / "a=b,c"
    odd.mkdir()
    teacher = odd / "model.safetensors"
    teacher.write_bytes(teacher_file.read_bytes())
    (odd / "model.json").write_bytes(teacher_file.with_suffix(".json").read_bytes())
    shown = _cli("--teacher", str(teacher), "--cfg", "job", "--resolve", "convert.recipe=logits", *TINY)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert f"teacher: {teacher}" in shown.stdout and "recipe: logits" in shown.stdout
    out = tmp_path / "sweep"
    swept = _cli("--teacher", str(teacher), "-m", "convert.recipe=logits,blocks", *TINY,
                 f"hydra.sweep.dir={out}")
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert len(list(out.rglob("export/model.safetensors"))) == 2  # one run folder per job
    bad = _cli("--teacher", str(teacher), "convert.recipe=fast", *TINY, "output_dir=" + str(tmp_path / "x"))
    assert bad.returncode == 2 and "convert.recipe='fast': expected one of" in bad.stderr.strip().splitlines()[-1]
    assert "Traceback" not in bad.stderr


def test_the_fit_report_names_its_steps_and_says_when_the_fields_were_not_fitted():
    """The fifth audit's E246: with convert.fit_steps=0 the report gave 'KL fit' figures of fields never fitted,
    naming no step count; it now says how the fields were fitted, or that they were not."""
    from ssogvit.convert.fit import format_report

    kwargs = {"num_classes": 5, "img_size": 16, "patch_size": 4, "embed_dim": 16, "num_heads": 2, "depth": 1}
    teacher = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs).eval()
    images = torch.randn(2, 3, 16, 16)
    unfitted = fit_fields(teacher, build_student(teacher).eval(), images, steps=0)
    fitted = fit_fields(teacher, build_student(teacher).eval(), images, steps=3, lr=0.05)
    assert (unfitted.steps, fitted.steps, fitted.lr) == (0, 3, 0.05)
    assert "were not fitted (convert.fit_steps=0)" in format_report(unfitted)
    assert "fitted by 3 Adam steps (learning rate 0.05)" in format_report(fitted)
