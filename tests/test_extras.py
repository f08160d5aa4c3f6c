"""The core stands alone: ``import ssogvit`` loads no extra, the core works with the extras uninstalled, and a command
whose extra is missing says in one line which one to install."""

import json
import subprocess
import sys

from ssogvit.extras import EXTRAS

#: what the extras bring (the import names in ssogvit.extras) and what comes with them, less what timm itself
#: requires (huggingface_hub; numpy and tqdm through it and torch)
EXTRA_MODULES = sorted({name.split(".")[0] for names in EXTRAS.values() for name in names}
                       - {"huggingface_hub", "numpy", "tqdm"} | {"pytorch_lightning", "submitit", "torchmetrics"})

#: a Python prologue that makes the extras' modules uninstalled, as in a `pip install ssogvit` environment: a name
#: bound to None in sys.modules is what `import` refuses and `importlib.util.find_spec` reports as not found
UNINSTALL = f"import sys; sys.modules.update(dict.fromkeys({EXTRA_MODULES!r}))\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_import_ssogvit_loads_none_of_the_extras():
    done = _python("import json, sys, ssogvit; print(json.dumps(sorted(sys.modules)))")
    assert done.returncode == 0, done.stderr
    loaded = {m.split(".")[0] for m in json.loads(done.stdout)}
    assert "ssogvit" in loaded and "timm" in loaded
    assert not loaded & set(EXTRA_MODULES), sorted(loaded & set(EXTRA_MODULES))


def test_the_core_works_without_the_extras_and_each_command_names_its_extra(tmp_path):
    code = UNINSTALL + f"""
import contextlib, io, json, torch, timm, ssogvit
from ssogvit.cli import main
from ssogvit.export import export_model, parity
from ssogvit.train.io import export_safetensors
out = {{}}
model = ssogvit.create_model("ode-tiny-ssog-steered", img_size=32, patch_size=8, depth=2, num_classes=3).eval()
x = torch.randn(2, 3, 32, 48)
out["logits"] = list(model(x).shape)
vit = ssogvit.ssogify(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3))
vit.save_pretrained({str(tmp_path / "hub")!r})
twin = timm.create_model("local-dir:" + {str(tmp_path / "hub")!r}, pretrained=True)
out["hub"] = all(torch.equal(a, b) for a, b in zip(vit.state_dict().values(), twin.state_dict().values()))
path = export_model(model, x, {str(tmp_path / "model.pt2")!r}, format="exported-program")
out["export_diff"] = parity(model, path, x, format="exported-program")
ckpt = export_safetensors(model, {str(tmp_path / "model.safetensors")!r})
for argv in (["export", "--ckpt", str(ckpt), "--format", "torchscript"],
             ["export", "--ckpt", str(ckpt), "--format", "onnx"],
             ["bench", "flops"], ["train"], ["main"], ["analyze", "fields"], ["list"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    out[" ".join(argv[:1] + argv[-1:])] = [status, err.getvalue()]
from ssogvit.cli import COMMANDS
for name in COMMANDS:  # help was asked: given without the extra (the command's own, or what to install)
    shown = io.StringIO()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(shown):
            status = main([name, "--help"])
    except SystemExit as stop:
        status = stop.code
    out["help " + name] = [status, shown.getvalue()]
print(json.dumps(out))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["logits"] == [2, 3] and out["hub"] is True and out["export_diff"] < 1e-5
    assert out["export torchscript"][0] == 0, out["export torchscript"]
    expected = {"export onnx": ("export", "--format onnx", "export"), "bench flops": ("bench", "this command", "bench"),
                "train train": ("train", "this command", "train"), "main main": ("main", "this command", "train"),
                "analyze fields": ("analyze", "this command", "analysis"), "list list": ("list", "this command", "train")}
    for key, (command, what, extra) in expected.items():
        status, err = out[key]
        assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (key, err)
        assert err.startswith(f"ssogvit {command}: {what} needs the '{extra}' extra ("), (key, err)
        assert err.rstrip().endswith(f"pip install 'ssogvit[{extra}]'"), (key, err)
    for name in ("main", "train", "eval", "transfer", "convert", "list", "report", "bench", "export", "analyze"):
        status, shown = out[f"help {name}"]
        assert status in (0, None) and shown.startswith(f"usage: ssogvit {name} "), (name, status, shown)
    assert "needs the 'train' extra" in out["help train"][1] and "--ckpt" in out["help export"][1]
    assert "{models,flops,operator,report,check}" in out["help bench"][1]  # its own help without matplotlib
