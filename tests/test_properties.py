"""Property-based tests (Hypothesis) of the public constructors and the mixers' call: whatever they are given, they
either build / compute what the declarations allow, or refuse with a one-line `ValueError` / `TypeError` naming an
argument they were given; never another exception, never a silently different result."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssogvit import create_mixer, create_model
from ssogvit.documents import DocumentError, parse_document
from ssogvit.errors import InputError
from ssogvit.specs import IMG_SIZE, Float, Int

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: values of every kind an argument may be handed by mistake
ANYTHING = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                     st.text(max_size=4), st.none(), st.lists(st.integers(0, 64), max_size=3))


def _refusal(err: BaseException, given: set[str]) -> None:
    """A refusal is a one-line ValueError / TypeError naming one of the arguments given."""
    assert isinstance(err, (ValueError, TypeError)), repr(err)
    text = str(err)
    assert text and "\n" not in text, text
    assert any(name in text for name in given), (text, given)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["img_size", "patch_size", "depth", "embed_dim", "num_heads", "num_classes",
                                        "in_chans", "num_registers", "drop_path_rate", "mlp_ratio", "num_atoms",
                                        "radius", "global_pool"]),
                       st.one_of(ANYTHING, st.integers(1, 8)), max_size=4),
       st.sampled_from(["vit", "looped", "ode"]), st.sampled_from(["ssog", "ssog-steered", "mha"]))
def test_create_model_builds_what_the_declarations_allow_or_names_the_argument(options, family, mixer):
    if mixer == "mha":  # SSoG options: MHA does not take them
        options = {k: v for k, v in options.items() if k not in ("num_atoms", "radius")}
    kwargs = {"embed_dim": 16, "num_heads": 2, "depth": 1, "img_size": 16, "patch_size": 4, **options}
    try:
        with torch.device("meta"):
            model = create_model(f"{family}-tiny-{mixer}", **kwargs)
    except Exception as err:  # noqa: BLE001 - the kind of error is the property
        _refusal(err, set(options) | {"embed_dim", "num_heads", "patch_size", "img_size", "drop_path_rate"})
        return
    for key, value in options.items():  # what was accepted is what the declarations allow, and is recorded
        if key in ("img_size",):
            assert model.img_size == ((value, value) if isinstance(value, int) else tuple(value))
        elif key in ("depth", "embed_dim", "num_heads", "num_classes", "in_chans", "num_registers", "patch_size"):
            assert isinstance(value, int) and not isinstance(value, bool) and model.config[key] == value
        elif key in ("drop_path_rate", "mlp_ratio", "radius"):
            assert math.isfinite(float(value)) and model.config[key] == float(value)
    with torch.device("meta"):
        assert create_model(**model.config).config == model.config


@SETTINGS
@given(st.sampled_from(["ssog", "ssog-steered", "mha", "mha-unfused"]), st.one_of(ANYTHING, st.integers(1, 64)),
       st.one_of(ANYTHING, st.integers(1, 8)),
       st.dictionaries(st.sampled_from(["num_atoms", "radius", "sigma_min", "tau_min", "proj_drop", "attn_drop",
                                        "bias", "qkv_bias", "impl", "head_chunk", "gate_init"]), ANYTHING,
                       max_size=2))
def test_create_mixer_builds_or_names_the_argument(name, dim, heads, options):
    try:
        with torch.device("meta"):
            mixer = create_mixer(name, dim, heads, **options)
    except Exception as err:  # noqa: BLE001
        _refusal(err, set(options) | {"dim", "num_heads", name})
        return
    assert isinstance(dim, int) and isinstance(heads, int) and dim % heads == 0 and 1 <= dim <= 8192
    assert mixer.num_heads == heads


@SETTINGS
@given(st.sampled_from(["ssog", "ssog-steered", "mha"]), st.integers(1, 6), st.integers(1, 6), st.integers(0, 4),
       st.one_of(st.none(), st.integers(0, 4)), st.integers(-3, 3), st.booleans())
def test_a_mixer_call_mixes_only_tokens_that_fit_the_grid(name, gh, gw, prefix, told, extra, float_grid):
    """Tokens `prefix + gh*gw + extra`; the grid `(gh, gw)` (as floats when `float_grid`); `num_prefix_tokens` told or
    not. Accepted exactly when the count fits: P = T - gh*gw >= 0, equal to the count told, or at most 1 untold."""
    mixer = create_mixer(name, 8, 2).eval()
    tokens = prefix + gh * gw + extra
    if tokens < 1:
        return
    x = torch.randn(1, tokens, 8)
    grid = (float(gh), float(gw)) if float_grid else (gh, gw)
    implied = tokens - gh * gw
    fits = not float_grid and implied >= 0 and (implied == told if told is not None else implied <= 1)
    try:
        with torch.no_grad():
            y = mixer(x, grid=grid, num_prefix_tokens=told)
    except ValueError as err:
        assert not fits, err
        assert "\n" not in str(err) and ("grid" in str(err) or "token count" in str(err)), err
        return
    assert fits and y.shape == x.shape and torch.isfinite(y).all()


@SETTINGS
@given(ANYTHING)
def test_an_integer_declaration_accepts_exactly_the_integers_in_its_range(value):
    try:
        got = IMG_SIZE.check(value, "img_size")
    except InputError as err:
        assert str(err).startswith("img_size=") and "expected an integer in [1, 16384]" in str(err)
        assert not (type(value) is int and 1 <= value <= 16384)
        return
    assert type(value) is int and 1 <= value <= 16384 and got == value


@SETTINGS
@given(st.text(max_size=30))
def test_a_command_line_value_is_parsed_strictly(text):
    for spec in (Int(0, 100), Float(0, 1)):
        try:
            value = spec.parse(text, "--x")
        except InputError as err:
            assert "\n" not in str(err) and str(err).startswith("--x=")
            continue
        assert (type(value) is int and 0 <= value <= 100) or (type(value) is float and 0 <= value <= 1)


@SETTINGS
@given(st.text(alphabet=st.sampled_from(list("ab:&*-[]{}!$,'\" \n12")), max_size=60))
def test_any_document_text_is_parsed_or_refused_as_a_document_error(text):
    try:
        parse_document(text, "config.yaml")
    except DocumentError as err:
        assert str(err).startswith("config.yaml: ") and "\n" not in str(err)


@pytest.mark.parametrize("text", ["a: &x [1, 2]\nb: *x\n", "a: 1\n"])
def test_examples_of_documents_that_parse(text):
    assert isinstance(parse_document(text, "config.yaml"), dict)
