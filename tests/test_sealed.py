"""One source of truth per weights file (`ssogvit.models.sealed`, docs/models.md "Saved and exported weights"): the
header's config is the one that holds, one digest covers the tensors and the whole header, the readable copy beside
it is checked and never preferred, and a file without a digest is named as unverified."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import cli_process

from ssogvit.models import create_model, from_pretrained
from ssogvit.models.sealed import DIGEST_KEY, SEALED_KEY, UnverifiedFileWarning, WeightsFileError
from ssogvit.train.errors import CheckpointError
from ssogvit.train.io import export_safetensors, load_model

TINY = dict(img_size=16, patch_size=4, num_classes=3, depth=1)


def _header(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def _rewrite(path, header):
    save_file(load_file(str(path)), str(path), metadata=header)


def _edit_copy(path, **changes):
    """Change keys of the model config in the readable copy (`model.json`) beside the export `path`."""
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text())
    meta["model_config"].update(changes)
    side.write_text(json.dumps(meta))


@pytest.fixture
def exported(tmp_path):
    model = create_model("looped-tiny-ssog", **TINY).eval()
    return model, export_safetensors(model, tmp_path / "model.safetensors")


def test_an_export_loads_the_model_it_sealed_and_refuses_an_edited_copy_beside_it(exported):
    model, path = exported
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sealed file loads without a word
        assert torch.equal(load_model(path)(x), model(x))
    for key, value in (("depth", 4), ("global_pool", "token"), ("num_atoms", 2)):
        side = path.with_suffix(".json")
        original = side.read_text()
        meta = json.loads(original)
        meta["model_config"][key] = value
        side.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError,
                           match=rf"model.json does not match the config sealed in .*\(model_config\.{key}: "):
            load_model(path)
        side.write_text(original)
    path.with_suffix(".json").unlink()  # the header alone is enough
    assert torch.equal(load_model(path)(x), model(x))


def test_the_digest_covers_the_header_and_a_file_without_one_is_named_unverified(exported):
    model, path = exported
    header = _header(path)
    config = json.loads(header["model_config"])
    _rewrite(path, {**header, "model_config": json.dumps({**config, "depth": 4}, sort_keys=True)})
    path.with_suffix(".json").unlink()
    with pytest.raises(CheckpointError, match="fails its integrity check"):
        load_model(path)
    _rewrite(path, {k: v for k, v in header.items() if k != DIGEST_KEY})
    with pytest.raises(CheckpointError, match="says it was sealed by ssogvit but its digest is missing"):
        load_model(path)
    _rewrite(path, {k: v for k, v in header.items() if k not in (DIGEST_KEY, SEALED_KEY)})
    with pytest.warns(UnverifiedFileWarning, match="carries no ssogvit digest"):
        load_model(path)


def test_a_saved_folder_is_sealed_and_its_config_json_is_checked_against_the_weights(tmp_path):
    model = create_model("vit-tiny-ssog-steered", **TINY).eval()
    folder = model.save_pretrained(tmp_path / "saved")
    x = torch.randn(2, 3, 16, 16)
    assert DIGEST_KEY in _header(folder / "model.safetensors")
    for loaded in (from_pretrained(folder), timm.create_model(f"local-dir:{folder}", pretrained=True),
                   load_model(folder / "model.safetensors")):
        assert torch.equal(loaded.eval()(x), model(x))
    original = (folder / "config.json").read_text()
    config = json.loads(original)
    config["pretrained_cfg"]["mean"] = [0.0, 0.0, 0.0]  # timm's preprocessing reads it: the whole copy is sealed
    (folder / "config.json").write_text(json.dumps(config))
    for load in (from_pretrained, lambda f: timm.create_model(f"local-dir:{f}", pretrained=True)):
        with pytest.raises(WeightsFileError, match=r"\(pretrained_cfg.mean: \[0.0, 0.0, 0.0\] in config.json"):
            load(folder)
    config = json.loads(original)
    config["model_args"]["depth"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsFileError, match=r"config.json does not match the config sealed .*\(model_args.depth: 3"):
        from_pretrained(folder)
    with pytest.raises(WeightsFileError, match="does not match the config sealed"):
        timm.create_model(f"local-dir:{folder}", pretrained=True)
    with pytest.raises(CheckpointError, match="does not match the config sealed"):
        load_model(folder / "model.safetensors")


def test_the_command_line_refuses_an_edited_copy_in_one_line(exported, tmp_path):
    _, path = exported
    _edit_copy(path, depth=4)
    res = cli_process.run(["export", "--ckpt", str(path), "--format", "torchscript", "--out", str(tmp_path / "m.pt")],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "model.json does not match the config sealed in" in res.stderr
    assert not (tmp_path / "m.pt").exists()


def test_timm_overlay_checks_the_copy_and_a_saved_folder_its_top_level_classes(exported, tmp_path):
    model, path = exported
    _edit_copy(path, depth=2)
    with pytest.raises(WeightsFileError,
                       match=r"model.json does not match the config sealed in .*\(model_config\.depth: 2"):
        timm.create_model("ssogvit_looped_tiny_ssog", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    folder = create_model("vit-tiny-ssog", **TINY).save_pretrained(tmp_path / "saved")
    config = json.loads((folder / "config.json").read_text())
    config["num_classes"] = 5
    (folder / "config.json").write_text(json.dumps(config))
    for load in (lambda: from_pretrained(folder), lambda: timm.create_model(f"local-dir:{folder}", pretrained=True)):
        with pytest.raises(ValueError, match="num_classes 5 differs from model_args' 3"):
            load()


def test_timm_file_overlay_takes_a_saved_folder_and_names_a_missing_file(tmp_path):
    model = create_model("vit-tiny-ssog", **TINY).eval()
    folder = model.save_pretrained(tmp_path / "saved")
    again = timm.create_model("ssogvit_vit_tiny_ssog", pretrained=True, pretrained_cfg_overlay=dict(file=str(folder)))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(again.eval()(x), model(x), rtol=0, atol=0)
    for missing, what in ((tmp_path / "nope.safetensors", ""), (tmp_path, r" \(a folder that is not a save_pretrained")):
        with pytest.raises(FileNotFoundError, match=f"no weights file {missing}{what}"):
            timm.create_model("ssogvit_vit_tiny_ssog", pretrained=True, pretrained_cfg_overlay=dict(file=str(missing)))


def test_eval_and_export_never_write_over_a_file_the_load_reads(exported, tmp_path):
    _, path = exported
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = path.with_suffix(".json").read_text()
    for args in (["eval", "--ckpt", str(path), "--json", str(path.with_suffix(".json")), "--overwrite", "data=digits"],
                 ["export", "--ckpt", str(path), "--format", "torchscript", "--out", str(path.with_suffix(".json")),
                  "--overwrite"]):
        res = cli_process.run(args, env=env, timeout=300)
        assert res.returncode == 2 and "is one of this command's inputs" in res.stderr, res.stderr[-2000:]
    assert path.with_suffix(".json").read_text() == before


def test_export_safetensors_replaces_a_file_only_when_asked(exported):
    model, path = exported
    from ssogvit.outputs import OutputExistsError

    with pytest.raises(OutputExistsError, match="pass overwrite=True"):  # the fifth audit's E085: the keyword
        export_safetensors(model, path)
    export_safetensors(model, path, overwrite=True)


@pytest.mark.parametrize("node", ["link", "folder", "run"])
def test_export_safetensors_writes_nothing_unless_both_files_may_be_written(exported, tmp_path, node):
    """The fifth audit's E092-E094: the weights and their readable copy are checked together before either is
    written (a link or a folder where the copy belongs left a sealed file without its copy), and a run's folder is
    its run's alone (a finished run's export was replaced with another model's, overwrite=True or not)."""
    from ssogvit.outputs import OutputError

    model, _ = exported
    folder = tmp_path / node
    folder.mkdir()
    target = folder / "model.safetensors"
    if node == "link":
        (folder / "model.json").symlink_to(tmp_path / "elsewhere.json")
    elif node == "folder":
        (folder / "model.json").mkdir()
    else:
        (folder / "run.json").write_text('{"status": "finished", "command": "train"}')
        target = folder / "export" / "model.safetensors"
    before = sorted(p.name for p in folder.rglob("*"))
    with pytest.raises(OutputError, match="model.json is a|the folder of a run"):
        export_safetensors(model, target, overwrite=True)
    assert sorted(p.name for p in folder.rglob("*")) == before and not (tmp_path / "elsewhere.json").exists()


@pytest.mark.parametrize("made_by", ["create_model", "timm", "from_pretrained", "ssogify"])
def test_save_pretrained_of_a_model_made_any_way_loads_back_the_same_model(made_by, tmp_path):
    """The audit's B37/B38/B40/B12: a model's config has one form (`img_size` as (H, W)) however it was made, so the
    sealed header and timm's config.json agree and the saved folder loads back, by timm's local-dir and by
    ssogvit's loaders, to the same outputs."""
    import ssogvit

    kw = dict(TINY, embed_dim=32, num_heads=2)
    torch.manual_seed(0)
    if made_by == "create_model":
        model = create_model("vit-tiny-ssog", **kw)
    elif made_by == "timm":
        model = timm.create_model("ssogvit_vit_tiny_ssog", **kw)
    elif made_by == "from_pretrained":
        create_model("vit-tiny-ssog", **kw).save_pretrained(tmp_path / "first")
        model = from_pretrained(tmp_path / "first")
    else:
        model = ssogvit.ssogify(timm.create_model("vit_tiny_patch16_224", **kw))
    model.eval().save_pretrained(tmp_path / "saved")
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sealed folder loads without a word
        loaded = [timm.create_model(f"local-dir:{tmp_path / 'saved'}", pretrained=True)]
        if made_by != "ssogify":  # ssogvit's loaders build ssogvit's models
            loaded += [from_pretrained(tmp_path / "saved"), load_model(tmp_path / "saved")]
    with torch.no_grad():
        for twin in loaded:
            assert torch.equal(twin.eval()(x), model(x))
