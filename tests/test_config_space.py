"""Property tests over the config space (issue 32, item 6B), with Hypothesis.

Drawn: a model config (family, mixer, task, patch, image size, prefix tokens, width, heads, depth, global pool,
classes, channels and the mixer's options) and inputs. Properties:

- `create_model` builds it or refuses it with a `ssogvit.errors.UserError` whose one-line message names one of the
  options given; never another exception;
- a built model's forward at a shape the patch divides gives finite outputs of the right shape, and a side the patch
  does not divide is refused with a `UserError`;
- export -> load (`export_safetensors`, `load_model`) gives the identical outputs;
- a sealed file with any one header entry or tensor changed (or removed, or an entry added) is refused.

Default run: small example counts (`PROFILE`); `slow` runs the same properties with many more examples.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ssogvit.errors import UserError
from ssogvit.layers import list_mixers
from ssogvit.models import FAMILIES, create_model
from ssogvit.models.sealed import DIGEST_KEY, SEALED_KEY
from ssogvit.train.io import export_safetensors, load_model

PROFILE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = settings(max_examples=25, **PROFILE)
MANY = settings(max_examples=300, **PROFILE)

#: mixer options drawn with each mixer (values within and beyond what the declarations allow)
MIXER_OPTIONS = {
    "ssog": {"num_atoms": st.integers(0, 5), "radius": st.sampled_from([0.5, 2.0, -1.0])},
    "ssog-steered": {"num_atoms": st.integers(0, 5), "radius": st.sampled_from([0.5, 2.0, -1.0])},
    "window": {"window_size": st.integers(0, 5), "shift_size": st.integers(-1, 4)},
    "neighborhood": {"kernel_size": st.integers(0, 6)},
}


#: the same options, drawn within what the declarations allow (the configs a forward is tested on)
VALID_OPTIONS = {
    "ssog": {"num_atoms": st.integers(1, 5), "radius": st.sampled_from([0.5, 2.0])},
    "ssog-steered": {"num_atoms": st.integers(1, 5), "radius": st.sampled_from([0.5, 2.0])},
    "window": {"window_size": st.integers(1, 5), "shift_size": st.just(0)},
    "neighborhood": {"kernel_size": st.sampled_from([1, 3, 5])},
}


@st.composite
def configs(draw, valid: bool = False) -> dict:
    """A model config: `create_model(**config)`; unless `valid`, some draws contradict the declarations on purpose
    (with `valid`, most build, so the properties of a built model see many)."""
    family = draw(st.sampled_from(list(FAMILIES)))
    mixer = draw(st.sampled_from(list_mixers()))
    patch = draw(st.integers(1, 6))
    side = st.integers(1, 6).map(lambda g: g * patch) | st.integers(1, 20)
    img = draw(side | st.tuples(side, side))
    config = {
        "name": f"{family}-tiny-{mixer}", "img_size": img, "patch_size": patch,
        "embed_dim": draw(st.sampled_from([4, 6, 8, 12])), "num_heads": draw(st.sampled_from([1, 2]) if valid
                                                                                else st.integers(1, 4)),
        "depth": draw(st.integers(1 if valid else 0, 2)), "num_registers": draw(st.integers(0, 2)),
        "in_chans": draw(st.integers(1, 3)), "num_classes": draw(st.integers(0, 4)),
    }
    if draw(st.booleans()):
        config["global_pool"] = draw(st.sampled_from(["token", "avg", "max", ""]))
    for key, values in (VALID_OPTIONS if valid else MIXER_OPTIONS).get(mixer, {}).items():
        if draw(st.booleans()):
            config[key] = draw(values)
    if draw(st.integers(0, 3)) == 0 and not (valid and patch < 4):
        config.update(task="segmentation", pyramid_dim=4, head_dim=4)
        if draw(st.booleans()) and not valid:
            config["feature_blocks"] = draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
    return config


def _build(config: dict):
    """The model, or the refusal: a `UserError` naming one of the options given in one line (any other exception
    fails the test)."""
    try:
        return create_model(**config)
    except UserError as err:
        text = str(err)
        assert text and "\n" not in text, text
        assert any(key in text for key in config), (text, config)
        return None


def _image_size(config: dict) -> tuple[int, int]:
    img = config["img_size"]
    return (img, img) if isinstance(img, int) else tuple(img)


@st.composite
def built(draw):
    """A config that builds, and its model (configs that are refused are drawn again)."""
    config = draw(configs(valid=True))
    model = _build(config)
    assume(model is not None)
    return config, model.eval()


def _check_builds_or_refuses(config):
    _build(config)


def _check_forward(pair, batch, grid_h, grid_w, off):
    config, model = pair
    p = config["patch_size"]
    x = torch.randn(batch, config["in_chans"], grid_h * p, grid_w * p)
    with torch.no_grad():
        y = model(x)
    assert torch.isfinite(y).all()
    classes = config["num_classes"]
    if config.get("task"):
        assert y.shape == (batch, classes, grid_h * p, grid_w * p)
    elif config.get("global_pool") == "":  # no pooling: the head on every token (prefix tokens included)
        tokens = model.num_prefix_tokens + grid_h * grid_w
        assert y.shape == (batch, tokens, classes if classes else model.num_features)
    else:
        assert y.shape == (batch, classes if classes else model.num_features)
    if p > 1:
        with pytest.raises(UserError, match=f"not divisible by the patch size {p}"):
            model(torch.randn(batch, config["in_chans"], grid_h * p + 1 + off % (p - 1), grid_w * p))


def _check_round_trip(pair, tmp_path_factory):
    config, model = pair
    path = export_safetensors(model, tmp_path_factory.mktemp("rt") / "model.safetensors")
    loaded = load_model(path)
    p = config["patch_size"]  # the model's image size, rounded up to whole patches (img_size may not be)
    x = torch.randn(2, config["in_chans"], *(-(-side // p) * p for side in _image_size(config)))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert json.dumps(loaded.config, sort_keys=True) == json.dumps(model.config, sort_keys=True)  # tuples as lists


@given(configs())
@FEW
def test_create_model_builds_or_refuses_with_a_user_error_naming_an_option(config):
    _check_builds_or_refuses(config)


@pytest.mark.slow
@given(configs())
@MANY
def test_create_model_builds_or_refuses_many(config):
    _check_builds_or_refuses(config)


FORWARD = dict(batch=st.integers(1, 2), grid_h=st.integers(1, 4), grid_w=st.integers(1, 4), off=st.integers(1, 5))


@given(pair=built(), **FORWARD)
@FEW
def test_a_built_model_computes_finite_outputs_and_refuses_a_size_the_patch_does_not_divide(pair, batch, grid_h,
                                                                                          grid_w, off):
    _check_forward(pair, batch, grid_h, grid_w, off)


@pytest.mark.slow
@given(pair=built(), **FORWARD)
@MANY
def test_forward_many(pair, batch, grid_h, grid_w, off):
    _check_forward(pair, batch, grid_h, grid_w, off)


@given(pair=built())
@settings(max_examples=10, **PROFILE)
def test_export_and_load_give_identical_outputs(pair, tmp_path_factory):
    _check_round_trip(pair, tmp_path_factory)


@pytest.mark.slow
@given(pair=built())
@settings(max_examples=150, **PROFILE)
def test_export_and_load_many(pair, tmp_path_factory):
    _check_round_trip(pair, tmp_path_factory)


# -- a sealed file changed in one place --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """A sealed export of a steered segmentation model (every kind of header entry and many tensors), its header and
    tensors; each example writes its own changed copy."""
    model = create_model("looped-tiny-ssog-steered", task="segmentation", num_classes=3, img_size=8, patch_size=4,
                         depth=1, embed_dim=8, num_heads=2, pyramid_dim=4, head_dim=4)
    path = export_safetensors(model, tmp_path_factory.mktemp("sealed") / "model.safetensors")
    path.with_suffix(".json").unlink()  # the header alone: the copy's own check is test_sealed.py's
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata())
    return path, header, load_file(str(path))


@st.composite
def changes(draw, header: dict, tensors: dict):
    """One change: a header entry edited, removed or added, or one element of one tensor changed."""
    kind = draw(st.sampled_from(["edit", "remove", "add", "tensor"]))
    if kind == "tensor":
        name = draw(st.sampled_from(sorted(tensors)))
        index = draw(st.integers(0, tensors[name].numel() - 1))
        value = draw(st.floats(-4, 4, allow_nan=False, width=32))
        return kind, name, (index, value)
    if kind == "add":
        return kind, draw(st.text("abcdefgh_", min_size=1, max_size=8).filter(lambda k: k not in header)), \
            draw(st.text(max_size=8))
    key = draw(st.sampled_from(sorted(header)))
    return kind, key, draw(st.text(max_size=12).filter(lambda v: v != header[key]))


def _check_change(sealed, tmp_path_factory, change):
    from ssogvit.train.errors import CheckpointError

    path, header, tensors = sealed
    kind, key, value = change
    header, tensors = dict(header), {k: v.clone() for k, v in tensors.items()}
    if kind == "tensor":
        flat = tensors[key].view(-1)
        old = flat[value[0]].clone()
        flat[value[0]] = value[1]
        assume(not torch.equal(flat[value[0]].view(torch.int32) if flat.dtype == torch.float32 else flat[value[0]],
                               old.view(torch.int32) if old.dtype == torch.float32 else old))
    elif kind == "remove":
        assume(not (key == DIGEST_KEY and SEALED_KEY not in header))
        del header[key]
    else:
        header[key] = value
    changed = tmp_path_factory.mktemp("changed") / "model.safetensors"
    save_file(tensors, str(changed), metadata=header)
    with pytest.raises(CheckpointError):
        load_model(changed)


@given(st.data())
@settings(max_examples=15, **PROFILE)
def test_a_sealed_file_changed_in_one_place_is_refused(sealed, tmp_path_factory, data):
    _check_change(sealed, tmp_path_factory, data.draw(changes(sealed[1], sealed[2])))


@pytest.mark.slow
@given(st.data())
@settings(max_examples=400, **PROFILE)
def test_a_sealed_file_changed_in_one_place_is_refused_many(sealed, tmp_path_factory, data):
    _check_change(sealed, tmp_path_factory, data.draw(changes(sealed[1], sealed[2])))
