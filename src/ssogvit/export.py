"""Deployment: a model written as ONNX, TorchScript or a ``torch.export`` program, checked against eager outputs.

    ssogvit export --ckpt runs/x/checkpoints/last.ckpt --format onnx [--out model.onnx]

The file is written, run again on a random batch (ONNX in onnxruntime) and compared with the eager model; the measured
maximum absolute difference is printed, and a parity worse than ``--tolerance`` is an error (exit code 2), the file
left beside for inspection. Under tracing and export SSoG takes no in-place or preallocated-buffer shortcut
(``ssogvit.ops.functional_only``), so what is exported computes what the eager model computes.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit.extras import missing

__all__ = ["FORMATS", "export_model", "load_exported", "parity", "main"]

#: format -> file suffix
FORMATS = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
TOLERANCE = 1e-4


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
                              output_names=["logits"], verbose=False)
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
    parser = argparse.ArgumentParser(prog="ssogvit export", description=main.__doc__)
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt or an exported .safetensors (config beside)")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", help="file to write (default: beside the checkpoint, with the format's suffix)")
    parser.add_argument("--batch", type=int, default=2, help="batch size of the traced example and the check")
    parser.add_argument("--onnx-exporter", choices=("dynamo", "torchscript"), default="dynamo")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest accepted max abs difference")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)

    ckpt = Path(args.ckpt)
    out = Path(args.out) if args.out else ckpt.with_suffix(FORMATS[args.format])
    if out.exists() and not args.overwrite:
        print(f"ssogvit export: {out} exists; pass --overwrite to replace it or --out for another file",
              file=sys.stderr)
        return 2
    if args.batch < 1:
        print(f"ssogvit export: --batch must be >= 1, got {args.batch}", file=sys.stderr)
        return 2
    if not args.tolerance >= 0:
        print(f"ssogvit export: --tolerance must be >= 0, got {args.tolerance}", file=sys.stderr)
        return 2
    if args.format == "onnx" and missing("export"):
        print(f"ssogvit export: --format onnx needs the 'export' extra ({', '.join(missing('export'))} not "
              "installed): pip install 'ssogvit[export]'", file=sys.stderr)
        return 2
    from ssogvit.train.io import CheckpointError, load_model

    try:
        model = load_model(ckpt).float().eval()
    except (CheckpointError, FileNotFoundError, OSError) as err:
        print(f"ssogvit export: cannot load {ckpt}: {err}", file=sys.stderr)
        return 2
    h, w = model.img_size
    x = torch.randn(args.batch, model.in_chans, h, w, generator=torch.Generator().manual_seed(0))
    export_model(model, x, out, format=args.format, dynamo=args.onnx_exporter == "dynamo")
    diff = parity(model, out, torch.randn(x.shape, generator=torch.Generator().manual_seed(1)), format=args.format)
    print(f"wrote {out} ({args.format}); parity on a random batch {tuple(x.shape)}: max abs difference {diff:.3e} "
          f"(tolerance {args.tolerance:.0e})")
    if not diff <= args.tolerance:
        print(f"ssogvit export: parity {diff:.3e} is worse than the tolerance {args.tolerance:.0e}; {out} does not "
              "compute what the model computes", file=sys.stderr)
        return 2
    return 0
