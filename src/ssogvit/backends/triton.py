"""The Triton backend (``impl="triton"``): fused fixed-SSoG mixing, forward and backward, as the ops
``ssogvit::triton_fixed_mix`` and ``ssogvit::triton_fixed_mix_backward`` (``torch.library.triton_op``, in
``_triton_kernels.py``). There is no Triton kernel for the steered mixing.

Triton is imported on first use only; ``import ssogvit`` never needs it. The kernel runs on CUDA tensors, or on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before first use; the tests do this).

What is fused: the whole contraction of the patch values (y-pass, x-pass, atom sum, mixture weights) in one kernel,
and the same kernel on the transposed kernels for the gradient with respect to the values. Not fused: the prefix
rows and the gradients with respect to the axis kernels, computed in torch by the helpers the torch backend uses
(``backends._common``; docs/operator.md, "Backends").
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from ssogvit import core

from ._common import tf32_enabled

__all__ = [
    "fixed_backward",
    "fixed_forward",
    "steered_backward",
    "steered_forward",
    "tf32_enabled",
    "triton_available",
    "triton_import_error",
    "triton_usable",
    "unsupported",
]

_STATE: dict = {}


def _kernels():
    """The lazily imported kernel module, or ``None`` when Triton cannot be imported (reason in ``_STATE``)."""
    if "mod" not in _STATE:
        try:
            from ssogvit.backends import _triton_kernels as mod
        except Exception as exc:  # ImportError, or a broken installation failing in its own way
            _STATE["mod"] = None
            _STATE["error"] = f"{type(exc).__name__}: {exc}"
        else:
            _STATE["mod"] = mod
            _STATE["error"] = None
    return _STATE["mod"]


def triton_available() -> bool:
    """Whether Triton (and this package's kernel) can be imported."""
    return _kernels() is not None


def triton_import_error() -> str | None:
    """Why Triton could not be imported (``None`` when it can)."""
    _kernels()
    return _STATE["error"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _probe(device: torch.device) -> bool:
    """Compile and run the kernel once on a tiny problem on ``device`` and compare it with the torch path; cached per
    device. A compiler or version mismatch then costs a warning and the torch path, not a crash mid-training."""
    key = ("probe", device.type, device.index)
    if key not in _STATE:
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            values = torch.randn(1, 1 + 12, 16, generator=g).to(device)
            ky = torch.softmax(torch.randn(1, 2, 3, 3, generator=g), -1).to(device)
            kx = torch.softmax(torch.randn(1, 2, 4, 4, generator=g), -1).to(device)
            lam = torch.softmax(torch.randn(1, 2, generator=g), -1).to(device)
            with torch.no_grad():
                got = _kernels().fixed_mix(values, ky, kx, lam)
                want = core.mix_fixed(values, (3, 4), ky, kx, lam)
            err = float((got - want).abs().max())
            if not err < 1e-3:
                raise RuntimeError(f"probe result differs from the torch path by {err:.3g}")
            _STATE[key] = None
        except Exception as exc:  # compilation, launch or a wrong result: anything the toolchain can do
            _STATE[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(
                f"ssogvit: the fused Triton kernel failed its probe on {device} ({_STATE[key]}); fixed SSoG uses the "
                f"torch path (impl='stacked') there",
                RuntimeWarning,
                stacklevel=3,
            )
    return _STATE[key] is None


@torch.compiler.assume_constant_result
def _usable(device_type: str, index: int | None) -> bool:
    if device_type == "cuda":
        return triton_available() and _probe(torch.device(device_type, index))
    return device_type == "cpu" and _interpreting() and triton_available()


def triton_usable(t: Tensor) -> bool:
    """Whether the kernel can run on ``t``: Triton imports, and ``t`` is a CUDA tensor whose device passed the
    kernel's probe (or a CPU tensor under the interpreter). ``torch.compile`` takes the answer as a constant."""
    return _usable(t.device.type, t.device.index)


@torch.compiler.assume_constant_result
def _fits(gw: int, atoms: int, dh: int, dtype: torch.dtype, device_type: str, index: int | None) -> bool:
    return _kernels().fits(gw, atoms, dh, dtype, torch.device(device_type, index))


@torch.compiler.assume_constant_result
def _tf32() -> bool:
    return tf32_enabled()


def unsupported(kind: str, values: Tensor, *operands: Tensor, auto: bool) -> str | None:
    """The probe of ``ssogvit.ops``: why the kernel cannot mix ``values`` with ``operands`` (``ky, kx, lam``; ``None``:
    it can). ``impl="auto"`` takes it for CUDA half precision, and for float32 only where TF32 is on (without it the
    kernel's dots are plain FMAs that spill registers); float64 and the CPU stay on the other backends."""
    if kind == "steered":
        return "there is no Triton kernel for the steered mixing (impl='cpu', 'stacked' or 'auto' mix it)"
    if kind != "fixed":
        return f"the Triton backend has no {kind} op: it mixes the tables torch builds"
    if auto and (not values.is_cuda or values.dtype == torch.float64
                 or (values.dtype == torch.float32 and not _tf32())):
        return "impl='auto' takes the Triton kernel for CUDA float16 and bfloat16, and float32 with TF32 on"
    if not triton_usable(values):
        if not triton_available():
            return f"impl='triton' needs Triton, which cannot be imported: {triton_import_error()}"
        if values.is_cuda:
            reason = _STATE.get(("probe", values.device.type, values.device.index))
            return f"impl='triton': the kernel failed its probe on {values.device}: {reason}"
        return f"impl='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1); got a {values.device} tensor"
    _, kx, lam = operands
    gw, (heads, atoms) = kx.shape[-1], lam.shape
    dh = values.shape[-1] // heads
    if not _fits(gw, atoms, dh, values.dtype, values.device.type, values.device.index):
        return (f"impl='triton': grid width {gw} with {atoms} atoms in {values.dtype} needs about "
                f"{_kernels().shared_bytes(gw, atoms, dh, values.dtype) // 1024} KiB of shared memory per program, "
                f"more than this device has; use impl='stacked' (impl='auto' does so by itself)")
    return None


def fixed_forward(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, *,
                  inplace: bool = False, head_chunk: int | None = None) -> Tensor:
    """``core.mix_fixed`` by the kernel (``inplace`` and ``head_chunk`` are ignored: the output is a new buffer)."""
    return _kernels().fixed_mix(values, ky, kx, lam)


def fixed_backward(grad: Tensor, values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``fixed_forward`` for ``values``, ``ky``, ``kx`` and ``lam``."""
    return _kernels().fixed_mix_backward(grad, values, ky, kx, lam)


def steered_forward(*args, **kwargs) -> Tensor:
    """There is no Triton kernel for the steered mixing (``unsupported`` says so before this is reached)."""
    raise RuntimeError(unsupported("steered", args[0], auto=False))


steered_backward = steered_forward
