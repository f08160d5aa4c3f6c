"""Deployment: a model written as ONNX, TorchScript or a ``torch.export`` program, checked against eager outputs.

    ssogvit export --ckpt runs/x/checkpoints/last.ckpt --format onnx [--out model.onnx]

The file is written under a temporary name beside ``--out``, run again on a random batch (ONNX in onnxruntime) and
compared with the eager model; the measured maximum absolute difference is printed. Only a file whose parity is within
``--tolerance`` is renamed to ``--out`` (atomically: a kill leaves the old file or nothing there); a worse one is an
error (exit code 2) and nothing is written. An existing ``--out`` is replaced only with ``--overwrite``. ONNX files
hold their weights (no ``.onnx.data`` beside them), so each export is one file. Under tracing and export SSoG takes no
in-place or preallocated-buffer shortcut (``ssogvit.ops.functional_only``), so what is exported computes what the eager
model computes.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit.inputs import Float, Int, check_memory
from ssogvit.outputs import OVERWRITE_FLAG, atomic_write, check_output_file

__all__ = ["FORMATS", "export_model", "load_exported", "parity", "main"]

#: format -> file suffix
FORMATS = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
TOLERANCE = 1e-4
BATCH = Int(1, 4096)  # images in the traced example


def export_model(model: nn.Module, example: Tensor, path: str | Path, *, format: str, dynamo: bool = True) -> Path:
    """Write ``model`` (in eval mode) traced on ``example`` to ``path``.

    Args:
        model: the model; put in eval mode.
        example: an input batch ``(B, C, H, W)``; the exported graph is for this shape.
        path: file to write.
        format: one of ``FORMATS``.
        dynamo: for ONNX, the ``torch.export``-based exporter (``False``: the TorchScript-based one).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    path = Path(path)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about constants: the graph is for the example's shape
        if format == "onnx":
            torch.onnx.export(model, (example,), str(path), dynamo=dynamo, input_names=["images"],
                              output_names=["logits"], verbose=False, external_data=False)  # one file
        elif format == "torchscript":
            torch.jit.save(torch.jit.trace(model, (example,)), str(path))
        else:
            torch.export.save(torch.export.export(model, (example,)), str(path))
    return path


def load_exported(path: str | Path, *, format: str):
    """A callable ``images -> outputs`` running the exported file (ONNX through onnxruntime on the CPU)."""
    if format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: torch.from_numpy(session.run(None, {name: x.detach().cpu().numpy()})[0])
    if format == "torchscript":
        return torch.jit.load(str(path)).eval()
    if format == "exported-program":
        return torch.export.load(str(path)).module()
    raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")


@torch.no_grad()
def parity(model: nn.Module, path: str | Path, x: Tensor, *, format: str) -> float:
    """Maximum absolute difference between the exported file's and the eager model's outputs on ``x``."""
    model.eval()
    expected = model(x)
    got = load_exported(path, format=format)(x)
    return float((got.to(expected) - expected).abs().max())


def main(argv: list[str] | None = None) -> int:
    """``ssogvit export``: write a checkpoint's model as a deployable file and print the parity it measured."""
    from ssogvit.errors import report_errors
    from ssogvit.train.cli import ArgumentParser

    parser = ArgumentParser(prog="ssogvit export", description=main.__doc__)
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt or an exported .safetensors (config beside)")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", help="file to write (default: beside the checkpoint, with the format's suffix)")
    parser.add_argument("--batch", type=BATCH.argparse, default=2,
                        help="batch size of the traced example and the check")
    parser.add_argument("--onnx-exporter", choices=("dynamo", "torchscript"), default="dynamo")
    parser.add_argument("--tolerance", type=Float(0).argparse, default=TOLERANCE,
                        help="largest accepted max abs difference")
    parser.add_argument(OVERWRITE_FLAG, action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    return report_errors("ssogvit export", lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from ssogvit.errors import UsageError
    from ssogvit.train.io import load_model

    ckpt = Path(args.ckpt)
    out = Path(args.out) if args.out else ckpt.with_suffix(FORMATS[args.format])
    check_output_file(out, "--out", overwrite=args.overwrite, inputs=[ckpt])  # before the (long) export
    model = load_model(ckpt).float().eval()
    h, w = model.img_size
    check_memory(model.forward_bytes(args.batch, (h, w)), f"a forward of {args.batch} images of {h}x{w} px", "--batch")
    if args.format == "onnx" and 4 * sum(p.numel() for p in model.parameters()) >= 2**31:
        raise UsageError("the model's weights exceed 2 GB, more than one ONNX file holds; export it as "
                         "--format exported-program or torchscript")
    x = torch.randn(args.batch, model.in_chans, h, w, generator=torch.Generator().manual_seed(0))
    check = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    measured: list[float] = []

    def write_checked(tmp: Path) -> None:
        export_model(model, x, tmp, format=args.format, dynamo=args.onnx_exporter == "dynamo")
        measured.append(parity(model, tmp, check, format=args.format))
        if not measured[0] <= args.tolerance:
            raise UsageError(f"parity {measured[0]:.3e} is worse than the tolerance {args.tolerance:.0e}: the "
                             f"exported file does not compute what the model computes, so {out} was not written")

    atomic_write(out, write_checked, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format}); parity on a random batch {tuple(x.shape)}: max abs difference "
          f"{measured[0]:.3e} (tolerance {args.tolerance:.0e})")
    return 0
