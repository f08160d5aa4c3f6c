"""Exported files keep the eager model's input contract, and segmentation models export like any other (issue 32).

Every format (TorchScript, ``torch.export``, ONNX through both exporters) refuses what the eager model refuses: a batch
of 0, another channel count, a side the patch does not divide (an 18x16 image at patch 4 once came out of the dynamo
ONNX file cropped to 16x16, and a batch of 0 killed onnxruntime's process with SIGFPE: ONNX files are therefore run in
a child process). Through ``export_model`` + ``load_exported`` for every family, the window and linear mixers and a
segmentation model, and through ``python -m ssogvit export`` in a subprocess (docs/models.md, Deployment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cli_process

import ssogvit.export
from ssogvit.export import FORMATS, dynamic_dims, export_model, load_exported, parity, refusal, refused_shapes
from ssogvit.models import create_model
from ssogvit.train.io import export_safetensors

TINY = dict(img_size=16, patch_size=4, depth=1, num_classes=5, embed_dim=16, num_heads=2)
SEGMENTATION = dict(task="segmentation", pyramid_dim=8, head_dim=8)
SHAPE = (2, 3, 16, 16)
#: what the eager model refuses near SHAPE: a batch of 0, 4 channels, 18x16 and 16x17 at patch 4
REFUSED = [(0, 3, 16, 16), (2, 4, 16, 16), (2, 3, 18, 16), (2, 3, 16, 17)]
#: (format, dynamo) -> test id
FORMAT_IDS = {("exported-program", True): "export", ("onnx", True): "onnx-dynamo", ("onnx", False): "onnx-torchscript",
              ("torchscript", False): "torchscript"}
#: (family, mixer, task); the window and linear mixers in the vit family (nothing family-specific in them)
MODELS = [("vit", "ssog", None), ("looped", "ssog", None), ("ode", "ssog", None), ("vit", "window", None),
          ("vit", "linear", None), ("vit", "ssog", "segmentation")]


def _model(family: str, mixer: str, task: str | None):
    torch.manual_seed(0)
    return create_model(f"{family}-tiny-{mixer}", **TINY, **(SEGMENTATION if task else {})).eval()


def _model_id(family: str, mixer: str, task: str | None) -> str:
    return f"{family}-{mixer}" + ("-seg" if task else "")


_CHILD = textwrap.dedent("""
    import json, sys, torch
    from ssogvit.export import load_exported
    run = load_exported(sys.argv[1], format=sys.argv[2])
    for shape in json.loads(sys.argv[3]):
        try:
            out = run(torch.randn(shape))
        except Exception as err:
            print(json.dumps([shape, None, type(err).__name__ + ": " + str(err)]), flush=True)
        else:
            print(json.dumps([shape, list(out.shape), None]), flush=True)
""")


def _run_in_child(path, fmt: str, shapes: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple]:
    """Each shape run through the file in a child process (onnxruntime died of SIGFPE on a batch of 0): shape ->
    (output shape or None, error or None); the child must exit 0."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), fmt, json.dumps(shapes)], capture_output=True,
                          text=True, env=os.environ.copy(), timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    return {tuple(shape): (out, err) for shape, out, err in rows}


def test_the_eager_model_refuses_what_every_file_must_refuse():
    for family, mixer, task in MODELS:
        model = _model(family, mixer, task)
        assert refused_shapes(SHAPE, 4) == REFUSED[:3]
        for shape in REFUSED:
            with pytest.raises((ValueError, RuntimeError)):
                with torch.no_grad():
                    model(torch.randn(shape))
        with pytest.raises(ValueError, match=r"an empty batch \(0, 3, 16, 16\): a model takes 1 image or more"):
            model(torch.randn(0, 3, 16, 16))
    assert refused_shapes((1, 1, 32, 32), 1) == [(0, 1, 32, 32), (1, 2, 32, 32)]  # patch 1 divides every size


def _slow(family: str, mixer: str, task: str | None, fmt: str, dynamo: bool) -> bool:
    """Kept out of the default run (the suite's 10-minute budget on 2 cores): a segmentation model's dynamic-size
    exports (over a minute: symbolic pyramid and head), and the dynamic exporters (torch.export, dynamo ONNX: 20-50 s
    each) of every model but the ViT, whose contract they share; every model runs through both TorchScript-based
    exporters by default."""
    heavy = fmt == "exported-program" or dynamo
    return heavy and (task == "segmentation" or (family, mixer) != ("vit", "ssog"))


_CASES = [pytest.param(*m, fmt, dyn, id=f"{FORMAT_IDS[fmt, dyn]}-{_model_id(*m)}",
                       marks=[pytest.mark.slow] if _slow(*m, fmt, dyn) else [])
          for m in MODELS for fmt, dyn in FORMAT_IDS]


@pytest.mark.parametrize("family, mixer, task, fmt, dynamo", _CASES)
def test_every_format_refuses_what_the_eager_model_refuses_and_computes_what_it_computes(
        family, mixer, task, fmt, dynamo, tmp_path):
    model = _model(family, mixer, task)
    path = export_model(model, torch.randn(SHAPE), tmp_path / f"model{FORMATS[fmt]}", format=fmt, dynamo=dynamo)
    other = (1, 3, 20, 24) if "size" in dynamic_dims(fmt, dynamo) else (1, 3, 16, 16)
    for shape in (SHAPE, other):  # parity at two shapes
        assert parity(model, path, torch.randn(shape), format=fmt) < 1e-4, shape
    if fmt == "onnx":  # in a child: the process must survive every refusal
        results = _run_in_child(path, fmt, REFUSED)
        assert sorted(results) == sorted(REFUSED)
        accepted = {shape: out for shape, (out, err) in results.items() if err is None}
        assert not accepted, f"the ONNX file took {accepted}"
        if dynamo:  # the graph's own check (the declared input shape fixes the channels only)
            for shape in [(0, 3, 16, 16), (2, 3, 18, 16), (2, 3, 16, 17)]:
                assert "indices element out of data bounds" in results[shape][1], results[shape]
        return
    for shape in REFUSED:
        why = refusal(model, path, torch.randn(shape), format=fmt)
        assert why is not None, f"{fmt} took a batch of shape {shape}"
    if fmt == "torchscript":
        assert "takes images (B >= 1, 3, 16, 16), got [0, 3, 16, 16]" in refusal(
            model, path, torch.randn(0, 3, 16, 16), format=fmt)
    else:
        assert refusal(model, path, torch.randn(0, 3, 16, 16), format=fmt) == (
            "AssertionError: Guard failed: images.size()[0] >= 1")
        assert "Guard failed: images.size()[2] % 4 == 0" in refusal(model, path, torch.randn(2, 3, 18, 16), format=fmt)


def test_refusal_names_what_the_eager_model_takes(tmp_path):
    model = _model("vit", "ssog", None)
    path = export_model(model, torch.randn(SHAPE), tmp_path / "m.pt2", format="exported-program")
    with pytest.raises(ValueError, match=r"the eager model takes a batch of shape \(1, 3, 20, 24\)"):
        refusal(model, path, torch.randn(1, 3, 20, 24), format="exported-program")


def test_export_model_replaces_a_file_only_when_asked(tmp_path):
    """`export_model` wrote over a user's file without a word (the audit's lost case B94)."""
    from ssogvit.outputs import OutputError

    mine = tmp_path / "m.pt"
    mine.write_bytes(b"my file")
    model = _model("vit", "ssog", None)
    with pytest.raises(OutputError, match="overwrite=True"):
        export_model(model, torch.randn(SHAPE), mine, format="torchscript")
    assert mine.read_bytes() == b"my file"
    export_model(model, torch.randn(SHAPE), mine, format="torchscript", overwrite=True)
    assert parity(model, mine, torch.randn(SHAPE), format="torchscript") < 1e-4


def _cli(ckpt, *args: str) -> subprocess.CompletedProcess:
    return cli_process.run(["export", "--ckpt", str(ckpt), *args], timeout=600)


def _cli_case(family, mixer, task, fmt, dynamo, tmp_path):
    ckpt = export_safetensors(_model(family, mixer, task), tmp_path / "model.safetensors")
    done = _cli(ckpt, "--format", fmt, *([] if fmt != "onnx" or dynamo else ["--onnx-exporter", "torchscript"]))
    static = task == "segmentation" and fmt == "exported-program"
    if static:  # docs/dense.md: its pyramid's arithmetic is fixed at the traced grid, so a dynamic size is refused
        assert done.returncode == 2 and "--static), or to ONNX" in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / f"model{FORMATS[fmt]}").exists()
        done = _cli(ckpt, "--format", fmt, "--static")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    out = tmp_path / f"model{FORMATS[fmt]}"
    assert out.is_file()
    parities = [line for line in done.stdout.splitlines() if line.startswith("parity on a random batch")]
    claimed = 1 if static else 3 if "size" in dynamic_dims(fmt, dynamo) else 2  # and a dynamic size's smallest grid
    assert len(parities) == claimed and all(float(p.split("difference ")[1].split()[0]) < 1e-4 for p in parities)
    prefix = "refused a batch of shape "
    refused = [line[len(prefix):].split(", as the model does (")[0] for line in done.stdout.splitlines()
               if line.startswith(prefix)]
    assert refused == [str(s) for s in REFUSED[:3]], done.stdout
    model = _model(family, mixer, task)
    assert parity(model, out, torch.randn(SHAPE), format=fmt) < 1e-4  # loads back and runs


#: the CLI in a subprocess: the ViT and the segmentation model through TorchScript by default (every format's file is
#: checked through the Python API above), every other case under `slow`
_CLI_CASES = [pytest.param(*m, fmt, dyn, id=f"{FORMAT_IDS[fmt, dyn]}-{_model_id(*m)}",
                           marks=[] if m in MODELS[::5] and fmt == "torchscript"
                           else [pytest.mark.slow])
              for m in MODELS for fmt, dyn in FORMAT_IDS]


@pytest.mark.parametrize("family, mixer, task, fmt, dynamo", _CLI_CASES)
def test_export_cli_writes_a_file_that_computes_and_refuses_as_the_model_does(family, mixer, task, fmt, dynamo,
                                                                              tmp_path):
    _cli_case(family, mixer, task, fmt, dynamo, tmp_path)


def test_export_cli_fails_when_the_file_takes_a_shape_the_model_refuses(tmp_path, monkeypatch, capsys):
    ckpt = export_safetensors(_model("vit", "ssog", "segmentation"), tmp_path / "model.safetensors")
    monkeypatch.setattr(ssogvit.export, "refusal", lambda *a, **k: None)  # a file without the graph's check
    assert ssogvit.export.main(["--ckpt", str(ckpt), "--format", "torchscript"]) == 2
    err = capsys.readouterr().err
    assert "the exported file took a batch of shape (0, 3, 16, 16), which the model refuses" in err
    assert "was not written" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.safetensors"]  # no file, no temporary



def test_export_takes_the_image_size_as_n_or_h_w_as_eval_does(tmp_path, capsys):
    ckpt = export_safetensors(_model("vit", "ssog", None), tmp_path / "model.safetensors")
    args = ["--ckpt", str(ckpt), "--format", "torchscript", "--static", "--batch", "1"]
    assert ssogvit.export.main([*args, "--img-size", "24"]) == 0
    assert "(1, 3, 24, 24)" in capsys.readouterr().out
    assert ssogvit.export.main([*args, "--img-size", "24", "32", "--overwrite"]) == 0
    assert "(1, 3, 24, 32)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ssogvit.export.main([*args, "--img-size", "24", "32", "40"])
    assert "unrecognized arguments: 40" in capsys.readouterr().err


def test_a_model_that_pads_is_refused_at_export_for_any_size_and_exports_at_its_own(tmp_path, capsys):
    """A ``dynamic_img_pad=True`` model pads a side the patch does not divide; a file of any size cannot hold the
    padding (the exporter fails on its own guards: audit C044, C045), so that export is refused in one line before any
    exporter runs; at the traced size (``--static``) it exports, and its file still refuses what it must."""
    torch.manual_seed(0)
    model = create_model("vit-tiny-ssog", **TINY, dynamic_img_pad=True).eval()
    with pytest.raises(ValueError, match="dynamic_img_pad=True"):
        export_model(model, torch.randn(SHAPE), tmp_path / "m.pt2", format="exported-program")
    assert not (tmp_path / "m.pt2").exists()
    assert refused_shapes(SHAPE, 4, pads=True) == REFUSED[:2]  # 18x16 is padded by the model, not refused
    ckpt = export_safetensors(model, tmp_path / "model.safetensors")
    assert ssogvit.export.main(["--ckpt", str(ckpt), "--format", "exported-program"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dynamic_img_pad=True" in err[0] and "--static" in err[0], err
    assert ssogvit.export.main(["--ckpt", str(ckpt), "--format", "exported-program", "--static"]) == 0
    out = capsys.readouterr().out
    assert "refused a batch of shape (0, 3, 16, 16)" in out and "(2, 3, 18, 16)" not in out, out


def _neighborhood_export(tmp_path):
    model = create_model("vit-tiny-neighborhood", img_size=32, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                         num_classes=3)
    return model, export_safetensors(model, tmp_path / "model.safetensors")


def test_neighborhood_attention_exports_through_its_tiled_path(tmp_path):
    """The fifth audit's E055-E058: under torch.export (and tracing) ``impl='auto'`` takes the tiled path, which every
    exporter holds; it took flex_attention there, which no exporter serialises ('Failed serializing node
    flex_attention'). The static exported program matches the eager model and keeps its contract."""
    model, ckpt = _neighborhood_export(tmp_path)
    done = _cli(ckpt, "--format", "exported-program", "--static")
    assert done.returncode == 0, done.stderr[-3000:]
    assert parity(model, tmp_path / "model.pt2", torch.randn(2, 3, 32, 32), format="exported-program") < 1e-5


@pytest.mark.slow
def test_a_dynamic_file_that_refuses_a_grid_it_would_claim_is_not_written(tmp_path):
    """The fifth audit's E059: the exported program of neighbourhood attention keeps guards on the grid it was
    traced at (its tiles' arithmetic), so it refused grids the model takes; the export now runs every file at the
    smallest grid it claims (2 x 3 patches) besides the two parity shapes, and refuses to write one that fails there,
    in one line saying what to do instead. ONNX, which holds the arithmetic, is written and checked at all three."""
    _, ckpt = _neighborhood_export(tmp_path)
    done = _cli(ckpt, "--format", "exported-program")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "does not take a batch of shape (2, 3, 8, 12), which the model takes" in done.stderr
    assert "export it with a static shape (dynamic=False, --static), or to ONNX" in done.stderr
    assert not (tmp_path / "model.pt2").exists()
    done = _cli(ckpt, "--format", "onnx")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "parity on a random batch (1, 3, 8, 12)" in done.stdout


@pytest.mark.parametrize("task", [None, "segmentation"])
def test_a_torchscript_file_runs_again_and_again_with_autograd_on(tmp_path, task):
    """The fifth audit's E221: a segmentation model's TorchScript file failed from its second call on, autograd on
    (the default), once TorchScript's executor had optimised the graph (an in-place ReLU after a permuted norm on a
    view of a parameter that required grad). The file is an inference file: its parameters do not require grad, and
    the model's own flags are as they were."""
    model = create_model("vit-tiny-ssog", img_size=32, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                         num_classes=3, **({"task": task} if task else {})).eval()
    path = export_model(model, torch.randn(2, 3, 32, 32), tmp_path / "m.pt", format="torchscript")
    assert all(p.requires_grad for p in model.parameters())
    run = load_exported(path, format="torchscript")
    for i in range(3):
        x = torch.randn(1 + i, 3, 32, 32)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(run(x), want, rtol=1e-4, atol=1e-5)
