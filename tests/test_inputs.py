"""One way in (`ssogvit.specs`, `ssogvit.documents`, `ssogvit.resources`; `ssogvit.inputs` names them all): one
declaration per argument checks a constructor's argument, a command-line option and a run-config key alike;
documents from disk are bounded and never interpolated; sizes beyond the machine are refused with the estimate."""

from __future__ import annotations

import argparse
import resource
from typing import Annotated

import numpy as np
import pytest
import torch

from ssogvit import documents, inputs, resources
from ssogvit.documents import DocumentError, input_file, input_folder, parse_document, read_document
from ssogvit.errors import InputError, InputTypeError
from ssogvit.resources import MemoryLimitError, check_device, check_memory
from ssogvit.models import check_model_config, create_model
from ssogvit.specs import IMG_SIZE, Choice, Flag, Float, Int, IntOrPair, Ints, Text, checked


@pytest.mark.parametrize("value, normalised", [(224, 224), (np.int64(224), 224), (np.int32(1), 1),
                                               (torch.tensor(7), 7), (16384, 16384)])
def test_an_integer_argument_takes_exact_integers(value, normalised):
    got = IMG_SIZE.check(value, "img_size")
    assert got == normalised and type(got) is int


@pytest.mark.parametrize("value, kind", [
    (224.5, InputTypeError), (224.0, InputTypeError), ("224", InputTypeError), (True, InputTypeError),
    (np.bool_(True), InputTypeError), (torch.tensor(4.0), InputTypeError), (torch.tensor([4]), InputTypeError),
    (None, InputTypeError), ([224], InputTypeError), (0, InputError), (-3, InputError), (16385, InputError),
])
def test_an_integer_argument_refuses_everything_else_naming_the_argument_and_the_range(value, kind):
    with pytest.raises(kind) as info:
        IMG_SIZE.check(value, "img_size")
    message = str(info.value)
    assert message.startswith("img_size=") and "expected an integer in [1, 16384]" in message
    assert "\n" not in message and info.value.argument == "img_size"
    assert isinstance(info.value, ValueError)  # a library user catches ValueError (and TypeError for the type)
    assert isinstance(info.value, TypeError) == (kind is InputTypeError)


def test_floats_choices_flags_and_text():
    rate = Float(0, 1, high_open=True)
    assert rate.check(0, "p") == 0.0 and rate.check(np.float32(0.5), "p") == 0.5
    for bad in (1.0, -0.1, float("nan"), float("inf"), "0.1", False):
        with pytest.raises(InputError, match=r"p=.*expected a number in \[0, 1\)"):
            rate.check(bad, "p")
    assert Float(finite=False).check(float("inf"), "x") == float("inf")
    with pytest.raises(InputError):
        Float(finite=False).check(float("nan"), "x")  # NaN is never a value
    mode = Choice(("linear", "finetune"))
    assert mode.check("linear", "mode") == "linear"
    for bad in ("Linear", 1, True, None):
        with pytest.raises(InputError, match="mode=.*expected one of 'linear', 'finetune'"):
            mode.check(bad, "mode")
    assert Flag().check(np.bool_(False), "f") is False
    for bad in (0, 1, "true", None):
        with pytest.raises(InputTypeError, match="expected true or false"):
            Flag().check(bad, "f")
    with pytest.raises(InputError, match="non-empty string"):
        Text().check("  ", "name")
    assert Int(1, also=(-1,)).check(-1, "epochs") == -1 and Int(none=True).check(None, "n") is None


def test_pairs_and_lists():
    size = IntOrPair(IMG_SIZE)
    assert size.check(32, "img_size") == 32 and size.check([32, np.int64(16)], "img_size") == (32, 16)
    for bad in ((32, 16.5), (32,), (32, 16, 8), (0, 32)):
        with pytest.raises(InputError, match=r"img_size=.*or a pair \(H, W\)"):
            size.check(bad, "img_size")
    sizes = Ints(Int(1))
    assert sizes.parse("16,14, 8", "--patch-sizes") == [16, 14, 8]
    for text in ("", "16,x", "16,0", "1.5"):
        with pytest.raises(InputError, match="--patch-sizes="):
            sizes.parse(text, "--patch-sizes")


@pytest.mark.parametrize("text, ok", [("32", 32), (" 7 ", 7), ("224.5", None), ("224.0", None), ("abc", None),
                                      ("0", None), ("99999", None), ("", None)])
def test_the_same_declaration_parses_a_command_line_option(text, ok, capsys):
    parser = argparse.ArgumentParser(prog="prog")
    parser.add_argument("--img-size", type=IMG_SIZE.argparse)
    if ok is not None:
        assert parser.parse_args(["--img-size", text]).img_size == ok
        return
    with pytest.raises(SystemExit):
        parser.parse_args(["--img-size", text])
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"argument --img-size: expected an integer in [1, 16384], got {text.strip()!r}" in err


def test_checked_checks_what_the_caller_passed_and_hands_on_normalised_values():
    @checked
    def build(width: Annotated[int, Int(1, 64)], *, rate: Annotated[float, Float(0, 1)] = 2.0, name: str = "x"):
        return width, rate, name

    assert build(np.int64(8)) == (8, 2.0, "x")  # the (unchecked) default stays the author's
    assert build(8, rate=1, name=3) == (8, 1.0, 3)  # unannotated parameters pass as they are
    with pytest.raises(InputTypeError, match=r"width=8\.0: expected an integer in \[1, 64\]"):
        build(8.0)
    with pytest.raises(InputError, match=r"rate=5: expected a number in \[0, 1\]"):
        build(8, rate=5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        build(8, bogus=1)


@pytest.mark.parametrize("call, needle", [
    (lambda: __import__("ssogvit").create_model("vit-tiny-ssog", img_size=224.5), "img_size=224.5"),
    (lambda: __import__("ssogvit").create_model("vit-tiny-ssog", drop_path_rate=5), "drop_path_rate=5"),
    (lambda: __import__("ssogvit").create_model("vit-tiny-ssog", num_classes="10"), "num_classes='10'"),
    (lambda: __import__("ssogvit").create_mixer("ssog", 0, 4), "dim=0"),
    (lambda: __import__("ssogvit").create_mixer("mha", 16, 2.0), "num_heads=2.0"),
    (lambda: __import__("ssogvit").create_mixer("ssog", 16, 2, num_atoms=0), "num_atoms=0"),
    (lambda: __import__("ssogvit").create_mixer("ssog", 16, 2, radius=float("nan")), "radius=nan"),
    (lambda: __import__("ssogvit").create_mixer("ssog-steered", 16, 2, gate_init={"mu": "x"}), "gate_init['mu']='x'"),
])
def test_the_public_constructors_use_the_declarations(call, needle):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(needle) and "expected" in str(info.value)


def test_a_model_too_large_for_the_machine_is_refused_with_the_estimate_before_allocating():
    from ssogvit import create_model

    with pytest.raises(MemoryLimitError, match=r"embed_dim=8192, depth=64.*needs at least 172 GB, more than"):
        create_model("vit-base-ssog", embed_dim=8192, num_heads=8, depth=64)
    with torch.device("meta"):  # shapes only: nothing to allocate, nothing refused
        assert create_model("vit-base-ssog", embed_dim=8192, num_heads=8, depth=64).depth == 64


def test_memory_limit_is_the_least_of_physical_cgroup_and_address_space(monkeypatch):
    monkeypatch.setattr(resources, "_cgroup_limit", lambda: 3 << 30)
    assert resources.memory_limit() == (3 << 30, "the cgroup memory limit")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resources._address_space_in_use() + (1 << 30), -1))
    limit, source = resources.memory_limit()
    assert source.startswith("the room left under RLIMIT_AS") and abs(limit - (1 << 30)) < 1 << 28
    with pytest.raises(MemoryLimitError, match=r"--img-size: a batch needs at least 2 GB, more than the room left "
                                               r"under RLIMIT_AS \(ulimit -v\) allows"):
        check_memory(2e9, "a batch", "--img-size")
    check_memory(1e6, "a batch", "--img-size")


def test_paths_and_devices(tmp_path):
    f = tmp_path / "w.ckpt"
    f.write_bytes(b"x")
    assert input_file(f, "--ckpt") == f and input_folder(tmp_path, "--calib") == tmp_path
    for path, needle in ((tmp_path, "is a folder, not a file"), (tmp_path / "nope", "does not exist"), ("", "path")):
        with pytest.raises(InputError, match=needle):
            input_file(path, "--ckpt")
    with pytest.raises(InputError, match="is a file, not a folder"):
        input_folder(f, "--calib")
    with pytest.raises(InputError, match="expected a name ending in .safetensors"):
        input_file(f, "--ckpt", suffixes=(".safetensors",))
    assert check_device("cpu").type == "cpu"
    with pytest.raises(InputError, match="device='gpu': expected a torch device"):
        check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available on this machine"):
            check_device("cuda")


# -- documents ----------------------------------------------------------------------------------------------------


def test_a_yaml_alias_bomb_is_refused_before_it_grows():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    with pytest.raises(DocumentError, match=f"more than {documents.MAX_YAML_ALIASES} YAML aliases"):
        parse_document(bomb, "config.yaml")
    assert parse_document("a: &x 1\nb: *x\n", "config.yaml") == {"a": 1, "b": 1}  # a few aliases are fine


@pytest.mark.parametrize("text", ["data:\n  root: ${oc.env:HOME}\n", "x: [1, '${oc.decode:1}']\n", "'${a}': 1\n"])
def test_an_interpolation_is_refused_and_never_resolved_or_shown(text, monkeypatch):
    monkeypatch.setenv("HOME", "/secret-home")
    with pytest.raises(DocumentError) as info:
        parse_document(text, "run/config.yaml")
    assert "interpolation" in str(info.value) and "secret" not in str(info.value) and "oc." not in str(info.value)


@pytest.mark.parametrize("text, needle", [
    ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ("a: [1, 2\n", "not valid YAML"),
    ("[" * 5000 + "]" * 5000, "not valid YAML"),
    ("x: " + "a" * (documents.MAX_DOCUMENT_BYTES + 1), "larger than"),
])
def test_unsafe_or_broken_yaml_is_refused(text, needle):
    with pytest.raises(DocumentError, match=needle):
        parse_document(text, "config.yaml")


def test_read_document_reads_json_as_json_and_bounds_the_file(tmp_path):
    (tmp_path / "model.json").write_text('{"model_config": {"name": "vit-tiny-ssog"}}')
    assert read_document(tmp_path / "model.json")["model_config"]["name"] == "vit-tiny-ssog"
    (tmp_path / "bad.json").write_text("a: 1")  # YAML, not JSON
    with pytest.raises(DocumentError, match="not valid JSON"):
        read_document(tmp_path / "bad.json")
    (tmp_path / "big.yaml").write_bytes(b"#" * (documents.MAX_DOCUMENT_BYTES + 1))
    with pytest.raises(DocumentError, match="larger than"):
        read_document(tmp_path / "big.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DocumentError, match="not UTF-8"):
        read_document(tmp_path / "bin.yaml")


@pytest.mark.parametrize("config, needle", [
    ({"name": "vit-base-ssog", "embed_dim": 65536}, "embed_dim=65536: expected an integer in [1, 8192]"),
    ({"name": "vit-base-ssog", "img_size": 224.5}, "img_size=224.5"),
    ({"name": "vit-base-ssog", "embed_dim": 8192, "num_heads": 64, "depth": 96}, "more than the limit"),
    ({"name": "vit_huge_patch14_224"}, "unknown model"),
    ({"name": "vit-base-ssog", "bogus": 1}, "does not build"),
    ({"name": "vit-base-ssog", "steer": "${oc.env:HOME}"}, "interpolation"),
    ([1], "must be a dict with a 'name'"),
])
def test_a_model_config_from_a_file_is_checked_on_the_meta_device(config, needle):
    with pytest.raises(DocumentError) as info:
        check_model_config(config, source="x/config.json")
    assert str(info.value).startswith("x/config.json: ") and needle in str(info.value)
    checked = check_model_config({"name": "vit-tiny-ssog", "img_size": 32}, source="ok")  # in the model's one form
    assert checked == create_model("vit-tiny-ssog", img_size=32, depth=1).config | {"depth": 12}
    assert checked["img_size"] == (32, 32)


def test_ssogvit_inputs_names_the_same_objects_as_the_modules_that_define_them():
    from ssogvit import errors, specs

    for name in inputs.__all__:
        homes = [m for m in (specs, documents, resources, errors) if name in getattr(m, "__all__", ())]
        assert len(homes) == 1 and getattr(inputs, name) is getattr(homes[0], name), name
