"""Every experiment config composes, builds its model, and differs from its twin only where it says."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

import cli_process

from ssogvit.models import create_model
from ssogvit.train.cli import list_main
from ssogvit.train.config import (
    IncompleteExperimentError, check_run_config, compose, experiment_meta, experiment_rows, list_experiments,
    model_config_from,
)
from ssogvit.train.io import build_model

EXPERIMENTS = list_experiments()
# The paper's CIFAR-100 and ImageNet tables and figure that the configs must cover.
REQUIRED = {f"Table {n}" for n in (1, 2, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16)} | {"Fig. 2"}
# How many runs (rows) each of those tables reports in the paper.
ROWS_PER_TABLE = {1: 6, 2: 6, 6: 3, 7: 10, 8: 4, 9: 3, 10: 18, 11: 31, 12: 12, 14: 3, 15: 3, 16: 12}


def test_every_required_table_has_experiments():
    covered = set()
    for name in EXPERIMENTS:
        paper = experiment_meta(name).get("paper") or ""
        covered |= {p.strip() for p in paper.split(",")}
    assert REQUIRED <= covered, f"missing: {sorted(REQUIRED - covered)}"


def test_one_config_per_reported_run_with_the_papers_label_and_number():
    rows = experiment_rows()
    counts = {t: sum(r["table"] == t for r in rows) for t in ROWS_PER_TABLE}
    assert counts == ROWS_PER_TABLE
    keys = [(r["table"], r["row"]) for r in rows]
    assert len(keys) == len(set(keys)), "two configs claim the same row of a table"
    for r in rows:
        assert r["top1"] is None or 0 < float(r["top1"]) < 100, r
    for name in EXPERIMENTS:
        meta = experiment_meta(name)
        tables = sorted({int(r["table"]) for r in meta.get("rows") or []})
        labels = [p.strip() for p in str(meta["paper"]).split(",")]
        if tables:
            assert [lab for lab in labels if lab.startswith("Table")] == [f"Table {t}" for t in tables], name
        elif not name.startswith("digits_"):
            assert meta["paper"] == "not in the paper" and "Not a run of the paper" in meta["description"], name
    assert experiment_rows(9) == [r for r in rows if r["table"] == 9]
    assert {r["row"]: r["top1"] for r in experiment_rows(9)} == {"M=2": 72.84, "M=4": 72.48, "M=7": 70.89}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_builds_its_model(name):
    cfg = compose([f"experiment={name}"], allow_unset=True)
    unset = list(cfg.meta.get("missing") or [])
    assert cfg.name == name and cfg.output_dir == f"runs/{name}"
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # nothing left unresolved
    mc = model_config_from(cfg)
    assert mc["name"] == f"{cfg.model.family}-{cfg.model.size}-{cfg.model.mixer}"
    classes = cfg.data.num_classes  # null for a folder of one's own (imagefolder_small): the run reads the folders
    mc.setdefault("num_classes", 7 if classes is None else classes)
    assert mc["num_classes"] == (7 if classes is None else classes)
    with torch.device("meta"):  # full-size models: shapes only, no memory or init time
        model = build_model(mc)
    assert model.num_classes == mc["num_classes"]
    assert sum(p.numel() for p in model.parameters()) > 0
    if unset:  # a detail the paper lacks: the experiment refuses to run until it is set
        assert all(OmegaConf.select(cfg, key) is None for key in unset)
        with pytest.raises(IncompleteExperimentError, match=re.escape(unset[0])):
            compose([f"experiment={name}"])
        return
    check_run_config(cfg)  # every value passes its declared spec, every key is a declared setting
    if name.startswith(("cifar100_", "imagenet_")):
        assert cfg.data.img_size == 224 and model.patch_size in (16, (16, 16))
        assert cfg.optim.weight_decay == 0.05 and cfg.mixup.mixup_alpha == 0.8 and cfg.mixup.cutmix_alpha == 1.0
        assert cfg.data.aug.auto_augment == "rand-m9-mstd0.5-inc1" and cfg.data.aug.re_prob == 0.25
    if name.startswith("cifar100_"):
        assert cfg.trainer.max_epochs == 500 and cfg.data.num_classes == 100
    if name.startswith("imagenet_"):
        assert cfg.data.name == "imagefolder" and cfg.data.num_classes == 1000


def _without_mixer(cfg):
    c = OmegaConf.to_container(cfg, resolve=True)
    for key in ("name", "output_dir", "meta", "logger"):  # where a run writes (the loggers write under output_dir)
        c.pop(key)
    c["model"].pop("mixer")
    c["model"].pop("name")
    c["loss"].pop("jasmin")  # the ODE MHA baseline trains with JaSMin, as ODE-ViT does
    return c


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
@pytest.mark.parametrize("dataset", ["cifar100", "imagenet"])
def test_ssog_and_mha_twins_differ_only_in_the_mixer(dataset, family):
    mha, ssog = (compose([f"experiment={dataset}_{family}_base_{m}"]) for m in ("mha", "ssog"))
    assert (mha.model.mixer, ssog.model.mixer) == ("mha", "ssog")
    assert _without_mixer(mha) == _without_mixer(ssog)
    assert ssog.loss.jasmin.weight == 0
    odevit = {"weight": 1.0, "kind": "jasmin", "k": 10, "maps": "last"}
    assert {k: mha.loss.jasmin[k] for k in odevit} == (odevit if family == "ode" else {**odevit, "weight": 0.0})


@pytest.mark.parametrize("size", ["small", "medium", "base"])
def test_every_ode_mha_baseline_trains_with_odevit_jasmin(size):
    cfg = compose([f"experiment=cifar100_ode_{size}_mha"])
    assert (cfg.loss.jasmin.weight, cfg.loss.jasmin.kind, cfg.loss.jasmin.k, cfg.loss.jasmin.maps) == (
        1.0, "jasmin", 10, "last")


def test_overrides_reach_the_model():
    cfg = compose(["experiment=cifar100_ode_base_steer_radius2", "model.kwargs.scale=6"])
    mc = model_config_from(cfg)
    assert mc["radius"] == 2 and mc["scale"] == 6 and mc["name"] == "ode-base-ssog-steered"
    assert "depth" not in mc  # null kwargs are left to the model's defaults
    cfg = compose(["experiment=cifar100_ode_base_steer_mu_sigma"])
    mc = model_config_from(cfg)
    assert list(mc["steer"]) == ["mu", "sigma"] and cfg.model.family == "ode"
    assert create_model(**{**mc, "img_size": 32, "patch_size": 8, "depth": 1}).config["steer"] == ("mu", "sigma")
    cfg = compose(["experiment=cifar100_ode_base_steer_mu_gate2", "model.kwargs.gate_init=-5"])
    assert model_config_from(cfg)["gate_init"] == -5


def test_default_config_is_the_digits_job():
    cfg = compose([])
    assert cfg.data.name == "digits" and cfg.seed == 42 and cfg.trainer.deterministic is True
    assert cfg.trainer.precision == "auto" and cfg.resume == "auto"


def test_list_shows_every_experiment(capsys):
    assert list_main(["experiments"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\S+)", out, flags=re.M)
    assert listed == EXPERIMENTS
    assert "Table 9" in out and "radius M=2" in out


def test_list_table_shows_its_runs_with_the_papers_number(capsys):
    assert list_main(["experiments", "--table", "7"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()[1:]]
    assert len(lines) == ROWS_PER_TABLE[7]
    by_name = {ln[0]: ln[-1] for ln in lines}
    assert by_name["cifar100_ode_base_ssog_steered_nfe6"] == "70.36" and by_name["cifar100_looped_base_ssog"] == "79.80"
    assert list_main(["--table", "10"]) == 0
    assert "missing" in capsys.readouterr().out  # Table 10's MHA numbers are not in our copy of the text


def test_cli_list_unknown_table_and_incomplete_experiment_exit_2(tmp_path):
    p = cli_process.run(["list", "experiments", "--table", "3"])
    assert p.returncode == 2 and "no experiment reproduces Table 3" in p.stderr and "Traceback" not in p.stderr
    p = cli_process.run(["train", "experiment=cifar100_ode_base_ssog_aug_weak", f"output_dir={tmp_path / 'r'}"])
    assert p.returncode == 2 and "data.aug.scale" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
def test_digits8_twins_differ_only_in_what_the_protocol_tunes(family):
    # the comparison protocol (docs/training.md): each mixer its own head and learning rate (and the ODE MHA twin its
    # JaSMin weight), chosen by a sweep; everything else the same
    cfgs = {m: compose([f"experiment=digits8_{family}_{m}"]) for m in ("ssog", "ssog_steered", "mha")}
    assert {m: c.model.mixer for m, c in cfgs.items()} == {"ssog": "ssog", "ssog_steered": "ssog-steered",
                                                          "mha": "mha"}
    assert [c.model.kwargs.global_pool for c in cfgs.values()] == ["avg", "avg", "token"]
    stripped = []
    for c in cfgs.values():
        assert c.trainer.max_epochs == 40 and c.data.batch_size == 32 and c.data.test_fraction > 0
        c = _without_mixer(c)
        c["model"]["kwargs"].pop("global_pool")
        c["optim"].pop("lr")
        stripped.append(c)
    assert stripped[0] == stripped[1] == stripped[2]
    assert all(cfgs[m].loss.jasmin.weight == 0 for m in cfgs)  # the paper's weight 1 stops the ODE MHA twin learning
