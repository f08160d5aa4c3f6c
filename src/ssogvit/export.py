"""Deployment: a model written as ONNX, TorchScript or a ``torch.export`` program, checked against eager outputs.

    ssogvit export --ckpt runs/x/checkpoints/last.ckpt --format onnx [--out model.onnx] [--static]

The file takes any batch size and, where the format allows, any image size the patch size divides (``DYNAMIC``):
``torch.export`` and the dynamo ONNX exporter make both dimensions symbolic; the TorchScript-based formats keep the
traced image size (the TorchScript-based ONNX exporter has no translation of the position embedding's antialiased
bicubic resize, and a traced TorchScript graph holds SSoG's grid as constants), and say so: onnxruntime refuses
another size by the file's declared input shape, the TorchScript file by a check of its own. ``--static`` exports
without dynamic dimensions (an ONNX file or exported program then refuses any other shape). Every file refuses
what the eager model refuses (a batch of 0, another channel count, a side the patch does not divide) by a check
inside it (``_Contract``), and the command proves it on the file (``refused_shapes``) before writing it.

The file is written under a temporary name beside ``--out`` and run again (ONNX in onnxruntime) on a random batch of
the traced shape and on one of another batch size and, where it is dynamic, another resolution, and compared with the
eager model; each maximum absolute difference is printed. Only a file whose parity is within ``--tolerance`` at every
shape is renamed to ``--out`` (atomically: a kill leaves the old file or nothing there); a worse one is an error (exit
code 2) and nothing is written. An existing ``--out`` is replaced only with ``--overwrite``. ONNX files hold their
weights (no ``.onnx.data`` beside them), so each export is one file. Under tracing and export SSoG takes no in-place
or preallocated-buffer shortcut (``ssogvit.ops.functional_only``), so what is exported computes what the eager model
computes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit.errors import ArgumentParser, InputError, UsageError, debug_enabled, report_errors
from ssogvit.extras import require_extra
from ssogvit.documents import input_file
from ssogvit.resources import check_memory
from ssogvit.specs import Float, Int, add_img_size_option
from ssogvit.outputs import OVERWRITE_FLAG, OutputError, atomic_write, check_output_file

__all__ = ["DYNAMIC", "FORMATS", "dynamic_dims", "export_model", "load_exported", "parity", "refusal", "refused_shapes",
           "second_shape", "main"]

#: format -> file suffix
FORMATS = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
#: (format, exporter) -> the input dimensions a file takes at any size; the others are fixed at the traced ones
DYNAMIC: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("exported-program", None): ("batch", "size"),
    ("onnx", "dynamo"): ("batch", "size"),
    ("onnx", "torchscript"): ("batch",),
    ("torchscript", None): ("batch",),
}
TOLERANCE = 1e-4
BATCH = Int(1, 4096)  # images in the traced example


def dynamic_dims(format: str, dynamo: bool = True) -> tuple[str, ...]:
    """The input dimensions (``"batch"``, ``"size"``: height and width) a file of ``format`` takes at any size."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    return DYNAMIC[(format, ("dynamo" if dynamo else "torchscript") if format == "onnx" else None)]


def _patch_size(model: nn.Module) -> int:
    """The model's patch size: ``patch_size`` (ours, a segmentation model's backbone's) or timm's ``patch_embed``."""
    patch = getattr(model, "patch_size", None) or model.patch_embed.patch_size
    return int(patch[0] if isinstance(patch, tuple | list) else patch)


def _pads(model: nn.Module) -> bool:
    """Whether the model pads a side the patch does not divide (``dynamic_img_pad=True``, timm's ``PatchEmbed``)
    instead of refusing it; a segmentation model's backbone says so for it."""
    embed = getattr(getattr(model, "backbone", model), "patch_embed", None)
    return bool(getattr(embed, "dynamic_img_pad", False))


def _in_chans(model: nn.Module) -> int:
    """The image channels the model takes."""
    chans = getattr(model, "in_chans", None)
    return int(chans if chans is not None else model.patch_embed.proj.in_channels)


@functools.cache
def _contract_check():
    """A scripted check that a traced TorchScript graph keeps (a traced Python check would vanish from the graph):
    the channels, a batch of 1 or more and the image size the graph was traced at."""

    def check_images(images: Tensor, channels: int, height: int, width: int) -> Tensor:
        if images.dim() != 4 or images.size(0) == 0 or images.size(1) != channels:
            raise ValueError("this TorchScript file takes images (B >= 1, {}, {}, {}), got {}".format(
                channels, height, width, images.shape))
        if images.size(2) != height or images.size(3) != width:
            raise ValueError(
                "this TorchScript file computes on {}x{} images only, got {}x{} (export to exported-program or "
                "ONNX with the dynamo exporter for any size)".format(height, width, images.size(2), images.size(3))
            )
        return images

    return torch.jit.script(check_images)


class _Contract(nn.Module):
    """The model behind its input contract, checked inside the exported graph (docs/models.md, Deployment).

    The eager model refuses a batch of 0, another channel count and a side the patch does not divide. An exported
    graph keeps none of that by itself: the dynamo ONNX exporter drops ``torch._check``-style asserts, and onnxruntime
    then crops an 18x16 image to 16x16 at patch 4 and dies of SIGFPE on a batch of 0. So the graph counts the
    violations from the input's shape as a tensor (which no exporter folds away) and indexes a one-element zero
    tensor with that count before the model sees the images: index 0 adds nothing, any other is out of bounds and
    the runtime raises (onnxruntime: ``indices element out of data bounds``) before any node of the model runs.
    TorchScript (``size``: the traced image size) also runs a scripted check with a message of its own.
    """

    def __init__(self, model: nn.Module, size: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.model, self.size = model, size
        self.channels, self.patch = _in_chans(model), _patch_size(model)

    def forward(self, images: Tensor) -> Tensor:
        if self.size is not None:
            images = _contract_check()(images, self.channels, self.size[0], self.size[1])
        shape = torch.stack([torch.scalar_tensor(d, dtype=torch.long) for d in images.shape])
        violations = (shape[0] == 0).long() + (shape[1] != self.channels).long() + (shape[2:] % self.patch != 0).sum()
        return self.model(images + images.new_zeros(1)[violations])


def _refuse_empty_batch(program: torch.export.ExportedProgram) -> None:
    """Make an exported program's first input check a batch of 1 or more.

    Its guards (checked before the graph runs) come from the model's shape arithmetic, in the order it met them;
    some divide by the batch, so a batch of 0 ended in ``ZeroDivisionError: integer modulo by zero`` before the
    graph's own check could refuse it. A guard put first refuses it as ``Guard failed: images.size()[0] >= 1``.
    """
    guards = getattr(program, "_guards_code", None)
    if isinstance(guards, list):
        program._guards_code = ["L['images'].size()[0] >= 1", *guards]


def _check_smallest(program: torch.export.ExportedProgram, model: nn.Module, shape: tuple[int, ...]) -> None:
    """A ``ValueError`` where the exported program refuses ``shape`` (a grid of 2 x 3 patches) that ``model`` takes:
    ``torch.export`` kept guards on the traced grid (neighbourhood attention's tiles, a segmentation pyramid)."""
    x = torch.randn(shape, dtype=next(model.parameters()).dtype)
    try:
        model(x)
    except Exception:  # the model itself refuses it: nothing to claim
        return
    try:
        program.module()(x)
    except Exception as err:
        raise ValueError(f"this model's exported program does not take a batch of shape {shape}, which the model "
                         f"takes ({_first_line(err)[:160]}): torch.export fixed part of its shape arithmetic at the "
                         "traced size; export it with a static shape (dynamic=False, --static), or to ONNX") from None


def export_model(
    model: nn.Module, example: Tensor, path: str | Path, *, format: str, dynamo: bool = True, dynamic: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (in eval mode) traced on ``example`` to ``path``.

    Args:
        model: the model (ours, of any family or task, or a timm ViT with ``patch_embed``); put in eval mode. The
            file holds it behind a check of its input contract (``_Contract``).
        example: an input batch ``(B, C, H, W)``; with ``dynamic``, ``B >= 2`` and a grid of at least 2 x 2 (an
            exporter fixes a dimension traced at size 1).
        path: file to write.
        format: one of ``FORMATS``.
        dynamo: for ONNX, the ``torch.export``-based exporter (``False``: the TorchScript-based one).
        dynamic: the dimensions ``dynamic_dims(format, dynamo)`` take any size; ``False``: the example's shape only.
        overwrite: replace an existing ``path`` (never done unasked).

    Raises:
        OutputError: ``path`` exists (it is replaced only with ``overwrite=True``) or cannot be written.
        ValueError: an unknown format, an example that would fix a dynamic dimension, or an ODE model whose adaptive
            solver chooses its steps from the data (no format holds that).
    """
    from ssogvit.models.ode import ADAPTIVE_SOLVERS

    path = check_output_file(path, "path", overwrite=overwrite, hint="overwrite=True")  # never a user's file unasked
    if getattr(model, "solver", None) in ADAPTIVE_SOLVERS:  # refused before any exporter dumps its graph
        raise ValueError(f"the ODE solver {model.solver!r} chooses its number of steps from the data, which no "
                         "exported format can hold; export the model built with a fixed-step solver (solver='rk4' "
                         "or 'euler', the same weights)")
    dims = dynamic_dims(format, dynamo) if dynamic else ()
    patch = _patch_size(model)
    if "size" in dims and _pads(model):  # refused here, not by the exporter's guards on the padding arithmetic
        raise ValueError(f"this model pads a side the patch ({patch}) does not divide (dynamic_img_pad=True), which "
                         "a file of any image size cannot hold; export it at its traced size (--static, or "
                         "dynamic=False), or pad the images to a multiple of the patch and export the model built "
                         "without dynamic_img_pad (the same weights)")
    b, _, h, w = example.shape
    if "batch" in dims and b < 2:
        raise ValueError(f"a dynamic batch is traced at batch 2 or more (an exporter fixes a dimension of size 1), "
                         f"got batch {b}")
    if "size" in dims and min(h, w) < 2 * patch:
        raise ValueError(f"a dynamic image size is traced at a grid of 2 x 2 patches or more, got {h}x{w} with "
                         f"patch {patch}")
    path = Path(path)
    model.eval()
    with torch.no_grad():  # an example the model refuses is refused in the model's words, not the exporter's
        model(example)
    batch = {0: torch.export.Dim("batch")} if "batch" in dims else {}
    size = {2: patch * torch.export.Dim("grid_h"), 3: patch * torch.export.Dim("grid_w")} if "size" in dims else {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about constants: the sizes they fix are the ones above
        checked = _Contract(model, (h, w) if format == "torchscript" else None)
        if format == "onnx" and dynamo:
            torch.onnx.export(checked, (example,), str(path), dynamo=True, input_names=["images"], verbose=False,
                              output_names=["logits"], dynamic_shapes=({**batch, **size},), external_data=False)
        elif format == "onnx":
            axes = {"images": {0: "batch"}, "logits": {0: "batch"}} if batch else None
            torch.onnx.export(checked, (example,), str(path), dynamo=False, input_names=["images"], verbose=False,
                              output_names=["logits"], dynamic_axes=axes, external_data=False)
        elif format == "torchscript":
            # an inference file: parameters that require grad made a later call of a traced in-place activation
            # (timm's ReLU(inplace=True) after a permuted norm) fail with autograd on, once the executor had optimised
            # the graph; the model's own flags are restored after the trace
            flags = [(p, p.requires_grad) for p in checked.parameters()]
            try:
                for p, _ in flags:
                    p.requires_grad_(False)
                torch.jit.save(torch.jit.trace(checked, (example,), check_trace=False), str(path))
            finally:
                for p, flag in flags:
                    p.requires_grad_(flag)
        else:
            program = torch.export.export(checked, (example,), dynamic_shapes=({**batch, **size},))
            _refuse_empty_batch(program)
            if size:  # the smallest grid the file would claim, before it is written (guards on the traced grid)
                _check_smallest(program, model, (b, example.shape[1], 2 * patch, 3 * patch))
            torch.export.save(program, str(path))
    return path


def load_exported(path: str | Path, *, format: str):
    """A callable ``images -> outputs`` running the exported file (ONNX through onnxruntime on the CPU). A file that
    is not of ``format`` (or not readable as one) is an ``InputError`` in one line, the loader's own log silenced."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # torch.export logs a traceback of its own before it raises
    try:
        return _load_exported(path, format)
    except ImportError:  # onnxruntime missing: the extra's own message (ssogvit.extras)
        raise
    except Exception as err:
        detail = _first_line(err)
        detail = "" if "warnings above" in detail else f" ({type(err).__name__}: {detail})"  # the log is silenced
        raise InputError(f"{path} cannot be read as format {format!r}{detail}; give the format it was written in, "
                         f"one of {list(FORMATS)}", argument="format") from None
    finally:
        torch_log.setLevel(level)


def _load_exported(path: str | Path, format: str):
    if format == "onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 4  # a refused input raises; no second copy of its message on stderr
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
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


def second_shape(shape: tuple[int, ...], dims: tuple[str, ...], patch: int) -> tuple[int, ...] | None:
    """Another input shape a file with the dynamic ``dims`` must take: batch 1 (3 after a traced batch of 1) and,
    with a dynamic size, one patch more in height and two in width (a rectangle); ``None`` with no dynamic dim."""
    b, c, h, w = shape
    if not dims:
        return None
    batch = (1 if b != 1 else 3) if "batch" in dims else b
    return (batch, c, h + patch, w + 2 * patch) if "size" in dims else (batch, c, h, w)


def smallest_shape(shape: tuple[int, ...], dims: tuple[str, ...], patch: int) -> tuple[int, ...] | None:
    """With a dynamic size, the smallest input a file claims to take: a grid of 2 x 3 patches (batch as
    ``second_shape``'s); an exporter's guards on a model's shape arithmetic may refuse grids smaller than the traced
    one, which the file must not claim. ``None`` without a dynamic size."""
    second = second_shape(shape, dims, patch)
    return None if "size" not in dims or second is None else (second[0], shape[1], 2 * patch, 3 * patch)


def refused_shapes(shape: tuple[int, ...], patch: int, *, pads: bool = False) -> list[tuple[int, ...]]:
    """Input shapes near ``shape`` that the eager model refuses, so every exported file must refuse them too: a batch
    of 0, one channel more and (patch > 1, a model that does not pad) a height the patch does not divide (18x16 from
    16x16 at patch 4)."""
    b, c, h, w = shape
    return [(0, c, h, w), (b, c + 1, h, w)] + ([(b, c, h + max(1, patch // 2), w)] if patch > 1 and not pads else [])


@torch.no_grad()
def refusal(model: nn.Module, path: str | Path, x: Tensor, *, format: str) -> str | None:
    """Why the exported file refused ``x`` (its error's type and first line), or ``None`` where it took it.

    Raises:
        ValueError: the eager model takes ``x``: there is nothing the file must refuse.
    """
    model.eval()
    try:
        model(x)
    except Exception:
        pass
    else:
        raise ValueError(f"the eager model takes a batch of shape {tuple(x.shape)}; the file need not refuse it")
    try:
        load_exported(path, format=format)(x)
    except Exception as err:
        return f"{type(err).__name__}: {_first_line(err)}"
    return None


def _first_line(err: BaseException) -> str:
    """The line of an error that says what went wrong (a TorchScript error's is its last: the raised error)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[-1] if "TorchScript interpreter" in lines[0] else lines[0]


def _describe(dims: tuple[str, ...], shape: tuple[int, ...], format: str, dynamo: bool) -> str:
    if dims == ("batch", "size"):
        return "any batch and image size (a multiple of the patch size)"
    fixed = f"{shape[2]}x{shape[3]} images"
    if dims == ("batch",):
        why = ("the TorchScript-based ONNX exporter cannot export the position embedding's resize" if format == "onnx"
               else "a traced TorchScript graph holds the grid as constants")
        return f"any batch; {fixed} only ({why}; the file refuses other sizes)"
    return f"batch {shape[0]} and {fixed}, the traced shape (--static: checked at it only)"


def main(argv: list[str] | None = None) -> int:
    """``ssogvit export``: write a checkpoint's model as a deployable file and print the parity it measured."""
    parser = ArgumentParser(prog="ssogvit export", description=main.__doc__)
    parser.add_argument("--ckpt", required=True,
                        help="a Lightning .ckpt, an exported .safetensors (config beside) or a save_pretrained folder")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", help="file to write (default: beside the checkpoint, with the format's suffix)")
    parser.add_argument("--batch", type=BATCH.argparse, default=2, help="batch of the traced example (default 2)")
    add_img_size_option(parser, "image size of the traced example (default: the model's img_size)")
    parser.add_argument("--static", action="store_true",
                        help="no dynamic dimensions: the file is for the traced shape (default: any batch and, "
                             "where the format allows, any image size)")
    parser.add_argument("--onnx-exporter", choices=("dynamo", "torchscript"), default=None,
                        help="with --format onnx: torch.onnx's exporter (default dynamo)")
    parser.add_argument("--tolerance", type=Float(0).argparse, default=TOLERANCE,
                        help="largest accepted max abs difference")
    parser.add_argument(OVERWRITE_FLAG, action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    if args.img_size_rest:
        parser.error(f"unrecognized arguments: {' '.join(args.img_size_rest)}")
    return report_errors("ssogvit export", lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from ssogvit.train.io import checkpoint_files, weights_path

    ckpt = input_file(weights_path(args.ckpt), "--ckpt", what="checkpoint")
    out = check_output_file(args.out or ckpt.with_suffix(FORMATS[args.format]), "--out", overwrite=args.overwrite,
                            inputs=checkpoint_files(ckpt))
    if out.suffix != FORMATS[args.format]:  # a file named for another format would be read as that one
        raise UsageError(f"--out {args.out}: a {args.format} file is named *{FORMATS[args.format]}; give --out with "
                         "that suffix")
    if args.format == "onnx":
        require_extra("export", "--format onnx")
    elif args.onnx_exporter:  # an option of another format would be ignored
        raise UsageError(f"--onnx-exporter chooses the exporter of --format onnx; --format {args.format} has none")
    dynamo = (args.onnx_exporter or "dynamo") == "dynamo"
    dims = () if args.static else dynamic_dims(args.format, dynamo)
    if "batch" in dims and args.batch < 2:
        raise UsageError("a dynamic batch is traced at --batch 2 or more (an exporter fixes a dimension traced at "
                         "size 1); pass --static for a file of batch 1 only")
    from ssogvit.train.io import load_model

    model = load_model(ckpt).float().eval()
    h, w = args.img_size or model.img_size
    patch, pads = _patch_size(model), _pads(model)
    if h % patch or w % patch:
        raise UsageError(f"--img-size {h} {w} is not a multiple of the patch size {patch}")
    if "size" in dims and min(h, w) < 2 * patch:
        raise UsageError(f"a dynamic image size is traced at 2 x 2 patches or more ({2 * patch} px here), got "
                         f"{h}x{w}; pass --img-size or --static")
    shape = (args.batch, model.in_chans, h, w)
    checks = [s for s in (shape, second_shape(shape, dims, patch), smallest_shape(shape, dims, patch)) if s is not None]
    for b, _, sh, sw in checks:
        check_memory(model.forward_bytes(b, (sh, sw)), f"a forward of {b} images of {sh}x{sw} px", "--batch")
    if args.format == "onnx" and 4 * sum(p.numel() for p in model.parameters()) >= 2**31:
        raise UsageError("the model's weights exceed 2 GB, more than one ONNX file holds; export it as "
                         "--format exported-program or torchscript")
    example = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    measured: list[float] = []

    def write_checked(tmp: Path) -> None:
        try:
            export_model(model, example, tmp, format=args.format, dynamo=dynamo, dynamic=not args.static)
        except Exception as err:  # the exporter's own refusal; the model is fine in eager
            if debug_enabled() or isinstance(err, OutputError):
                raise
            first = _first_line(err)
            raise UsageError(f"{args.format} could not export this model ({type(err).__name__}: {first}); --debug "
                             "shows the traceback") from None
        print(f"exported {args.format}: it takes {_describe(dims, shape, args.format, dynamo)}")
        for i, check in enumerate(checks):
            x = torch.randn(check, generator=torch.Generator().manual_seed(1 + i))
            try:
                measured.append(parity(model, tmp, x, format=args.format))
            except Exception as err:  # the file refused an input it claims to take
                first = _first_line(err)
                way = (" (the exporter fixed part of the model's shape arithmetic at the traced size: export it with "
                       "--static, or to ONNX)" if i else "")
                raise UsageError(f"the exported file failed on a batch of shape {check} ({first[:200]}), which the "
                                 f"model takes, so {out} was not written{way}") from None
            print(f"parity on a random batch {check}: max abs difference {measured[-1]:.3e} (tolerance "
                  f"{args.tolerance:.0e})")
            if not measured[-1] <= args.tolerance:
                raise UsageError(f"parity {measured[-1]:.3e} is worse than the tolerance {args.tolerance:.0e}: the "
                                 f"exported file does not compute what the model computes, so {out} was not written")
        # what the eager model refuses, the file must refuse
        for i, bad in enumerate(refused_shapes(shape, patch, pads=pads)):
            why = refusal(model, tmp, torch.randn(bad, generator=torch.Generator().manual_seed(100 + i)),
                          format=args.format)
            if why is None:
                raise UsageError(f"the exported file took a batch of shape {bad}, which the model refuses, so {out} "
                                 "was not written")
            print(f"refused a batch of shape {bad}, as the model does ({why[:100]})")

    atomic_write(out, write_checked, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format})")
    return 0
