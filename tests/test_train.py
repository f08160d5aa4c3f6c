"""The training pipeline end to end on tiny models: metrics, checkpoints, export, loading, determinism, resume."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
import torch

from ssogvit.train import CheckpointError, ConfigError, load_model
from ssogvit.train.config import compose
from ssogvit.train.io import atomic_checkpoint_io, read_model_config
from ssogvit.train.losses import (
    attention_penalty, jasmin_g, jasmin_options, jasmin_penalty, softmax_jacobian_estimate, softmax_jacobian_penalty,
    topk_correct,
)
from ssogvit.train.run import resolve_resume, train

REPO = Path(__file__).resolve().parents[1]


def tiny(out: Path, *extra: str, mixer: str = "ssog", epochs: int = 2) -> list[str]:
    """Overrides for a seconds-long run: a 1-block width-32 model on 64 synthetic 16 px images."""
    return [
        "data=synthetic", "data.img_size=16", "data.train_size=64", "data.val_size=32", "data.batch_size=16",
        "data.learnable=true", "model=vit", "model.size=tiny", f"model.mixer={mixer}", "model.kwargs.embed_dim=32",
        "model.kwargs.num_heads=2", "model.kwargs.depth=1", "model.kwargs.patch_size=4",
        "model.kwargs.drop_path_rate=0.0", f"trainer.max_epochs={epochs}", "trainer.enable_progress_bar=false",
        "trainer.accelerator=cpu", "trainer.devices=1", "trainer.log_every_n_steps=1", f"output_dir={out}",
        "ckpt.every_n_train_steps=2", *extra,
    ]


def read_metrics(run: Path, version: int = 0) -> list[dict[str, str]]:
    with open(run / "logs" / f"version_{version}" / "metrics.csv") as f:
        return list(csv.DictReader(f))


# losses and metrics ---------------------------------------------------------------------------------------------------
def _softmax_jacobian_norm(p: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(torch.diag(p) - torch.outer(p, p), ord=2))


def test_softmax_jacobian_estimate_matches_the_norm_where_exact():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    est = softmax_jacobian_estimate(rows)
    assert torch.allclose(est, torch.tensor([0.25, 0.0, 0.5], dtype=torch.float64))
    for p, e in zip(rows, est):
        assert math.isclose(float(e), _softmax_jacobian_norm(p), abs_tol=1e-12)
    # sorted order does not matter, and the estimate is within a factor 2 of the true norm on random rows
    p = torch.softmax(torch.randn(200, 7, dtype=torch.float64) * 3, dim=-1)
    assert torch.allclose(softmax_jacobian_estimate(p), softmax_jacobian_estimate(p.flip(-1)))
    true = torch.tensor([_softmax_jacobian_norm(r) for r in p], dtype=torch.float64)
    ratio = softmax_jacobian_estimate(p) / true
    assert float(ratio.min()) > 0.5 and float(ratio.max()) < 2.0


def test_softmax_jacobian_penalty_reductions_and_gradient():
    logits = torch.randn(2, 3, 5, 5, requires_grad=True)  # (B, H, T, T)
    maps = [torch.softmax(logits, -1), torch.softmax(2 * logits, -1)]
    mean, worst = softmax_jacobian_penalty(maps, reduce="mean"), softmax_jacobian_penalty(maps, reduce="max")
    rows = torch.stack([softmax_jacobian_estimate(m) for m in maps], 1)
    assert torch.allclose(mean, rows.mean())
    assert torch.allclose(worst, rows.flatten(1).amax(1).mean()) and worst >= mean
    worst.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="reduce"):
        softmax_jacobian_penalty(maps, reduce="sum")


UNIFORM = [0.25, 0.25, 0.25, 0.25]
ONE_HOT = [0.0, 0.0, 1.0, 0.0]
TWO_POINT = [0.0, 0.5, 0.5, 0.0]
EPS = 1e-12


@pytest.mark.parametrize(
    ("row", "k", "expected"),
    [
        # g_1 = p1 (1 - p1 + p2): uniform 1/4, one-hot 0, two-point 1/2
        (UNIFORM, 0, math.log(0.25 + EPS)),
        (ONE_HOT, 0, math.log(EPS)),
        (TWO_POINT, 0, math.log(0.5 + EPS)),
        # Eq. 9: uniform g_2 = 1/4, g_4 = (1/4)(3/4); two-point g_2 = (1/2)(1/2), g_3 = 0
        (UNIFORM, 2, 0.0),
        (UNIFORM, 4, math.log(0.25 + EPS) - math.log(3 / 16 + EPS)),
        (ONE_HOT, 2, 0.0),
        (TWO_POINT, 2, math.log(0.5 + EPS) - math.log(0.25 + EPS)),
        (TWO_POINT, 3, math.log(0.5 + EPS) - math.log(EPS)),
    ],
)
def test_jasmin_on_hand_computed_rows(row, k, expected):
    a = torch.tensor(row, dtype=torch.float64).expand(1, 1, 4, 4)  # every row the same: max over rows is the row
    assert math.isclose(float(jasmin_penalty([a], k)), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_jasmin_reduces_by_max_over_rows_then_mean_over_heads_images_and_maps():
    rows = torch.tensor([UNIFORM, ONE_HOT, TWO_POINT, UNIFORM], dtype=torch.float64)
    g1 = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)  # hand-computed g_1 of each row
    a = torch.stack([rows, rows.roll(1, 0), rows[[0, 0, 3, 1]]])[None]  # (1, 3, 4, 4): three heads
    per_head = [math.log(float(g1.max()) + EPS), math.log(float(g1.max()) + EPS), math.log(0.25 + EPS)]
    assert math.isclose(float(jasmin_penalty([a], 0)), sum(per_head) / 3, rel_tol=1e-12)
    b = torch.tensor(UNIFORM, dtype=torch.float64).expand(1, 3, 4, 4)
    both = float(jasmin_penalty([torch.cat([a, b])], 0))  # two images
    assert math.isclose(both, (sum(per_head) / 3 + math.log(0.25 + EPS)) / 2, rel_tol=1e-12)
    assert math.isclose(float(jasmin_penalty([a, b], 0)), both, rel_tol=1e-12)  # maps: their mean


def _jasmin_by_loops(maps: list[torch.Tensor], k: int) -> float:
    """Independent reference: python loops over images, heads and rows, sorting with `sorted`."""
    def g(sorted_row: list[float], rank: int) -> float:
        nxt = sorted_row[rank] if rank < len(sorted_row) else 0.0
        return sorted_row[rank - 1] * (1 - sorted_row[rank - 1] + nxt)

    per_map = []
    for a in maps:
        vals = []
        for img in a.tolist():
            for head in img:
                losses = []
                for row in head:
                    s = sorted(row, reverse=True)
                    loss = math.log(g(s, 1) + EPS)
                    losses.append(loss - math.log(g(s, k) + EPS) if k else loss)
                vals.append(max(losses))
        per_map.append(sum(vals) / len(vals))
    return sum(per_map) / len(per_map)


@pytest.mark.parametrize("k", [0, 2, 10])
def test_jasmin_matches_a_loop_reference_on_random_maps(k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(3, 2, 12, 12, 3, dtype=torch.float64, generator=gen) * 3  # 3 maps of (3, 2, 12, 12)
    logits.requires_grad_(True)
    maps = list(torch.softmax(logits, dim=-2).unbind(-1))
    got = jasmin_penalty(maps, k)
    assert got.dtype == torch.float64
    assert math.isclose(float(got.detach()), _jasmin_by_loops([m.detach() for m in maps], k), rel_tol=1e-12)
    got.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # row order inside a row does not matter
    perm = torch.randperm(12, generator=gen)
    assert math.isclose(float(jasmin_penalty([m[..., perm] for m in maps], k)), float(got.detach()), rel_tol=1e-12)
    # `maps=last` penalises only the last map of the forward pass
    opts = jasmin_options({"k": k})
    assert opts == {"kind": "jasmin", "k": k, "maps": "last", "reduce": "mean"}
    assert math.isclose(float(attention_penalty(maps, **opts)), _jasmin_by_loops([maps[-1].detach()], k),
                        rel_tol=1e-12)
    assert math.isclose(float(attention_penalty(maps, **{**opts, "maps": "all"})), float(got.detach()), rel_tol=1e-12)


def test_jasmin_g_and_bad_options_are_clear_errors():
    p = torch.tensor(TWO_POINT, dtype=torch.float64)
    assert [float(jasmin_g(p, k)) for k in (1, 2, 3, 4)] == [0.5, 0.25, 0.0, 0.0]
    a = torch.tensor(UNIFORM, dtype=torch.float64).expand(1, 1, 4, 4)
    for bad, match in [(1, "k must be 0"), (-1, "k must be 0"), (5, "k <= 4")]:
        with pytest.raises(ValueError, match=match):
            jasmin_penalty([a], bad)
    with pytest.raises(ValueError, match="attention maps"):
        jasmin_penalty([], 0)
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        jasmin_penalty([a[0]], 0)
    for cfg, match in [({"kind": "spectral"}, "kind"), ({"maps": "first"}, "maps"), ({"k": 1}, "k must be"),
                       ({"reduce": "sum"}, "reduce"), ({"wieght": 1}, "unknown loss.jasmin keys")]:
        with pytest.raises(ValueError, match=match):
            jasmin_options(cfg)


def test_topk_counts():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    c = topk_correct(logits, torch.tensor([1, 1, 0]), ks=(1, 2, 5))
    assert (int(c[1]), int(c[2]), int(c[5])) == (1, 2, 3)  # k above the class count counts everything


# a run ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    summary = train(compose(tiny(out, epochs=3)), verbose=False)
    return out, summary


def test_run_logs_train_and_val_metrics(trained):
    out, summary = trained
    rows = read_metrics(out)
    cols = set(rows[0])
    for split in ("train", "val"):
        for m in ("top1", "top3", "top5"):
            assert f"{split}/{m}" in cols
    assert {"train/loss_epoch", "val/loss"} <= cols
    val = [r for r in rows if r["val/top1"]]
    assert len(val) == 3 and all(0 <= float(r["val/top1"]) <= float(r["val/top3"]) <= float(r["val/top5"]) <= 100
                                  for r in val)
    assert list((out / "tb" / "version_0").glob("events.out.tfevents.*"))
    assert summary["epochs"] == 3 and summary["steps"] == 12 and math.isfinite(summary["metrics"]["val/loss"])
    assert (out / "config.yaml").is_file()


def test_checkpoints_and_export_rebuild_the_same_model(trained):
    out, summary = trained
    ckpts = out / "checkpoints"
    assert (ckpts / "last.ckpt").is_file() and (ckpts / "best.ckpt").is_file()
    assert not list(ckpts.glob("*-v*.ckpt")) and not list(ckpts.glob(".*tmp*"))
    export = out / "export" / "model.safetensors"
    meta = json.loads(export.with_suffix(".json").read_text())
    assert meta["model_config"]["name"] == "vit-tiny-ssog" and meta["model_config"]["embed_dim"] == 32
    x = torch.randn(3, 3, 16, 16)
    from_ckpt, from_export = load_model(ckpts / "last.ckpt"), load_model(export)
    assert not from_ckpt.training
    torch.testing.assert_close(from_ckpt(x), from_export(x), rtol=0, atol=0)
    assert read_model_config(ckpts / "last.ckpt") == from_ckpt.config
    # the checkpoint is plain data: it loads with weights_only=True and holds the config as a dict
    ckpt = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["model_config"]["name"] == "vit-tiny-ssog"
    # last.ckpt is the final state: all 3 epochs (12 steps) done, the same weights as the export
    assert ckpt["epoch"] == 3 and ckpt["global_step"] == 12 and ckpt["ssogvit"]["resumable"]
    for k, v in from_export.state_dict().items():
        assert torch.equal(ckpt["state_dict"]["model." + k], v), k


def test_truncated_checkpoint_is_a_clear_error_and_leaves_the_others(trained, tmp_path):
    out, _ = trained
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for name in ("last.ckpt", "best.ckpt"):
        (ckpts / name).write_bytes((out / "checkpoints" / name).read_bytes())
    data = (ckpts / "last.ckpt").read_bytes()
    (ckpts / "last.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_model(ckpts / "last.ckpt")
    assert "best.ckpt" in str(err.value)
    cfg = compose(tiny(tmp_path))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        resolve_resume(cfg, ckpts)  # resume=auto refuses the torn last.ckpt instead of failing mid-restore
    assert (ckpts / "last.ckpt").stat().st_size == len(data) // 2  # left in place for the user
    assert load_model(ckpts / "best.ckpt") is not None
    with pytest.raises(CheckpointError, match=r"config.yaml is a text file, not a checkpoint: expected a Lightning"):
        load_model(out / "config.yaml")  # the run's config, handed over by mistake


def test_a_failed_checkpoint_write_leaves_the_previous_file(tmp_path):
    io = atomic_checkpoint_io()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    before = target.read_bytes()
    with pytest.raises(Exception):  # torch.save dies half-way: a lambda cannot be pickled
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "bad": lambda: 0}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))


def test_checkpoint_loading_never_runs_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"state_dict": {}, "hyper_parameters": {"x": Evil()}}, tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "evil.ckpt")
    assert not (tmp_path / "pwned").exists()


def test_same_seed_gives_identical_metrics(trained, tmp_path):
    out, first = trained
    second = train(compose(tiny(tmp_path / "again", epochs=3)), verbose=False)
    assert first["metrics"] == second["metrics"]
    cols = ("epoch", "step", "train/loss_step", "train/loss_epoch", "val/loss", "val/top1", "val/top5")
    assert [[r[c] for c in cols] for r in read_metrics(out)] == \
        [[r[c] for c in cols] for r in read_metrics(tmp_path / "again")]
    a, b = load_model(out / "export" / "model.safetensors"), load_model(tmp_path / "again" / "export" / "model.safetensors")
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k


def test_eval_and_transfer_commands(trained, tmp_path, capsys):
    from ssogvit.train.cli import eval_main, transfer_main

    out, summary = trained
    res = tmp_path / "eval.json"
    assert eval_main(["--ckpt", str(out / "checkpoints" / "best.ckpt"), "--json", str(res), "--device", "cpu"]) == 0
    got = json.loads(res.read_text())
    assert math.isclose(got["top1"], summary["best"], abs_tol=1e-3) and got["images"] == 32
    # another image size (dynamic resolution) and another patch size (FlexiViT resize of the patch embedding)
    assert eval_main(["--ckpt", str(out / "export" / "model.safetensors"), "--img-size", "24", "--patch-size", "2",
                      "--json", str(res), "--overwrite", "--device", "cpu"]) == 0
    got = json.loads(res.read_text())
    assert got["img_size"] == 24 and got["patch_size"] == 2 and 0 <= got["top1"] <= 100
    # linear probe onto a 4-class dataset: only the new head may change
    src = load_model(out / "checkpoints" / "best.ckpt")
    dst = tmp_path / "probe"
    assert transfer_main(["--ckpt", str(out / "checkpoints" / "best.ckpt"), "--mode", "linear",
                          *tiny(dst, "data.num_classes=4", "data.seed=7", epochs=1)]) == 0
    probe = load_model(dst / "export" / "model.safetensors")
    assert probe.num_classes == 4 and probe.head.out_features == 4
    for (k, v), v0 in zip(probe.state_dict().items(), src.state_dict().values()):
        if not k.startswith("head."):
            assert torch.equal(v, v0), f"{k} changed during a linear probe"
    assert "transfer_linear_synthetic" in capsys.readouterr().out


def test_jasmin_and_ema_options_train(tmp_path):
    out = tmp_path / "opts"
    s = train(compose(tiny(out, "loss.jasmin.weight=0.5", "loss.jasmin.kind=softmax-jacobian", "loss.jasmin.reduce=max",
                           "ema.enabled=true", "ema.decay=0.9", mixer="mha", epochs=1)), verbose=False)
    assert math.isfinite(s["metrics"]["train/jasmin"]) and 0 < s["metrics"]["train/jasmin"] <= 0.5
    assert "val_ema/top1" in s["metrics"]
    ema = load_model(out / "export" / "model_ema.safetensors")
    raw = load_model(out / "export" / "model.safetensors")
    assert any(not torch.equal(a, b) for a, b in zip(ema.state_dict().values(), raw.state_dict().values()))
    torch.testing.assert_close(load_model(out / "checkpoints" / "last.ckpt", use_ema=True).state_dict()["head.weight"],
                               ema.state_dict()["head.weight"])


def test_ode_mha_trains_with_jasmin_as_odevit_does(tmp_path):
    """The ODE-ViT recipe (Eq. 9, k=10, last map, weight 1) trains end to end; a bad option stops the run early."""
    base = tiny(tmp_path / "ode", "model=ode", "loss.jasmin.weight=1.0", mixer="mha", epochs=1)
    s = train(compose(base), verbose=False)
    assert math.isfinite(s["metrics"]["train/jasmin"])
    with pytest.raises(ConfigError, match="loss.jasmin.k"):
        train(compose([*base, "loss.jasmin.k=1", f"output_dir={tmp_path / 'bad'}"]), verbose=False)
    assert not (tmp_path / "bad").exists()  # nothing is written before the launch is known to be valid


def test_a_short_epoch_is_logged_once_an_epoch_and_lines_say_the_time_left():
    """docs/training.md, "What a run prints": the small-data recipe on a few hundred images (6 batches an epoch) logs
    every epoch instead of Lightning warning that `log_every_n_steps=10` is never reached."""
    from ssogvit.train.progress import format_duration
    from ssogvit.train.run import log_interval

    cfg = compose(["experiment=imagefolder_small", "data.root=/nowhere"])
    assert (log_interval(cfg, 1000), log_interval(cfg, 6), log_interval(cfg, None)) == (10, 6, 10)
    cfg.trainer.limit_train_batches = 4
    assert log_interval(cfg, 1000) == 4
    cfg.trainer.limit_train_batches = 0.5
    assert log_interval(cfg, 6) == 3
    assert [format_duration(s) for s in (0.4, 59, 725, 11220)] == ["0 s", "59 s", "12 min 05 s", "3 h 07 min"]


def test_eval_takes_the_image_size_as_n_or_h_w_as_export_does(trained, tmp_path, capsys):
    """One `--img-size` syntax (docs/training.md): N or H W, an override after it still an override."""
    from ssogvit.train.cli import eval_main

    out, _ = trained
    res = tmp_path / "eval.json"
    assert eval_main(["--ckpt", str(out / "export" / "model.safetensors"), "--img-size", "24", "24",
                      "data.batch_size=8", "--json", str(res), "--device", "cpu"]) == 0
    assert json.loads(res.read_text())["img_size"] == 24
    capsys.readouterr()
    assert eval_main(["--ckpt", str(out / "export" / "model.safetensors"), "--img-size", "24", "32"]) == 2
    assert "eval resizes the data to square images" in capsys.readouterr().err
