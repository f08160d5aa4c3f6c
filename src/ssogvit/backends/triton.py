"""The Triton backend: fused fixed-SSoG mixing (forward and backward), behind ``ops.ssog_mix(..., impl="triton")``.

Triton is imported on first use only; ``import ssogvit`` never needs it. The kernel runs on CUDA tensors, or on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before first use; the tests do this).

What is fused: the whole contraction of the patch values (y-pass, x-pass, atom sum, mixture weights) in one kernel,
and the same kernel on the transposed kernels for the gradient with respect to the values. Not fused: the prefix
rows and the gradients with respect to the axis kernels, computed in torch by the helpers the torch backend uses
(``backends._common``; docs/operator.md, "Backends").
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch import Tensor

from ._common import add_prefix_grad, head_grads, tf32_enabled, write_prefix_pool
from .torch import mix_fixed

__all__ = [
    "auto_picks_triton",
    "ssog_mix_triton",
    "tf32_enabled",
    "triton_available",
    "triton_import_error",
    "triton_usable",
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
                got = _TritonMix.apply(values, ky, kx, lam, 3, 4)
                want = mix_fixed(values, (3, 4), ky, kx, lam, impl="einsum", inplace=False, head_chunk=None,
                                 grad_needed=False)
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


def triton_usable(t: Tensor, grid: tuple[int, int] | None = None, atoms: int | None = None) -> bool:
    """Whether the Triton path can run on ``t``: a CUDA tensor whose device passed the kernel's probe (or a CPU tensor
    under the interpreter) and Triton.

    With ``grid`` and ``atoms`` also that the kernel's x-pass tiles fit the device's shared memory (for the widest
    channel block the kernel uses, so whatever the head width)."""
    if t.is_cuda:
        ok = triton_available() and _probe(t.device)
    else:
        ok = t.device.type == "cpu" and _interpreting() and triton_available()
    if ok and grid is not None and atoms is not None:
        ok = _kernels().fits(int(grid[1]), int(atoms), 64, t.dtype, t.device)
    return ok


def auto_picks_triton(t: Tensor, grid: tuple[int, int], atoms: int) -> bool:
    """What ``impl="auto"`` does on ``t``: the kernel for CUDA half precision, and for float32 only where TF32 is on
    (without it the kernel's dots are plain FMAs that spill registers); float64 and CPU stay on the torch path."""
    if not t.is_cuda or t.dtype == torch.float64 or (t.dtype == torch.float32 and not tf32_enabled()):
        return False
    return triton_usable(t, grid, atoms)


def ssog_mix_triton(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor) -> Tensor:
    """Same contract as ``ops.ssog_mix``: ``values (B, P + N, D)``, ``ky (H, R, Gh, Gh)``, ``kx (H, R, Gw, Gw)``,
    ``lam (H, R)``; returns ``(B, P + N, D)`` with the prefix rows the mean patch value."""
    gh, gw = (int(g) for g in grid)
    if not triton_usable(values):
        if not triton_available():
            raise RuntimeError(f"impl='triton' needs Triton, which cannot be imported: {triton_import_error()}")
        if values.is_cuda:
            reason = _STATE.get(("probe", values.device.type, values.device.index))
            raise RuntimeError(f"impl='triton': the kernel failed its probe on {values.device}: {reason}")
        raise RuntimeError(
            f"impl='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1); got a {values.device} tensor"
        )
    b, t, d = values.shape
    h, r = lam.shape
    if d % h:
        raise ValueError(f"width {d} is not divisible by {h} heads")
    if t < gh * gw:
        raise ValueError(f"token count {t} does not fit the grid {gh}x{gw}")
    if tuple(ky.shape) != (h, r, gh, gh) or tuple(kx.shape) != (h, r, gw, gw):
        raise ValueError(
            f"kernel shapes {tuple(ky.shape)}, {tuple(kx.shape)} do not match H={h}, R={r}, grid {gh}x{gw}"
        )
    mod = _kernels()
    if not mod.fits(gw, r, d // h, values.dtype, values.device):
        raise ValueError(
            f"impl='triton': grid width {gw} with {r} atoms in {values.dtype} needs about "
            f"{mod.shared_bytes(gw, r, d // h, values.dtype) // 1024} KiB of shared memory per program, more than "
            f"this device has; use impl='stacked' (impl='auto' does so by itself)"
        )
    return _TritonMix.apply(values, ky, kx, lam, gh, gw)


def _launch(src: Tensor, ky: Tensor, kx: Tensor, lam: Tensor, dst: Tensor, grid: tuple[int, int]) -> None:
    mod = _kernels()
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        mod.launch_mix(src, ky, kx, lam, dst, grid)


class _TritonMix(torch.autograd.Function):
    """Saves only the values and the kernel tables. Backward: the kernel on transposed (strided) kernels gives the
    values' gradient; the kernels' gradients recompute the x-pass one head at a time in torch."""

    @staticmethod
    def forward(ctx, values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor, gh: int, gw: int) -> Tensor:
        values = values.contiguous()
        b, t, d = values.shape
        p = t - gh * gw
        out = values.new_empty(b, t, d)
        write_prefix_pool(out, values, p)
        _launch(values[:, p:], ky, kx.to(values.dtype), lam, out[:, p:], (gh, gw))
        ctx.save_for_backward(values, ky, kx, lam)
        ctx.grid = (gh, gw)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the values' gradient is written by the kernel, off the tape
            raise RuntimeError(
                "the fused Triton SSoG kernel is once differentiable: its backward cannot be differentiated again "
                "(create_graph=True, e.g. a gradient penalty); use impl='stacked', which can"
            )
        values, ky, kx, lam = ctx.saved_tensors
        gh, gw = ctx.grid
        b, t, d = values.shape
        p = t - gh * gw
        grad = grad.contiguous()
        gp = grad[:, p:]
        need_v, need_ky, need_kx, need_lam = ctx.needs_input_grad[:4]
        g_values = g_ky = g_kx = g_lam = None
        if need_v:
            g_values = values.new_empty(b, t, d)
            if p:
                g_values[:, :p] = 0
            kx_t = kx.to(values.dtype).transpose(-1, -2)
            _launch(gp, ky.transpose(-1, -2), kx_t, lam, g_values[:, p:], (gh, gw))
            add_prefix_grad(g_values, grad, p)
        if need_ky or need_kx or need_lam:
            kdt = torch.float64 if values.dtype == torch.float64 else torch.float32
            ky_k, lam_k = ky.to(kdt), lam.to(kdt)
            kyl = ky_k * lam_k[:, :, None, None]
            g_kyl, g_kx = _kernel_grads(values[:, p:], gp, kyl, kx, (gh, gw), need_ky or need_lam, need_kx)
            if need_ky:
                g_ky = (g_kyl * lam_k[:, :, None, None]).to(ky.dtype)
            if need_lam:
                g_lam = (g_kyl * ky_k).sum(dim=(-1, -2)).to(lam.dtype)
        return g_values, g_ky, g_kx, g_lam, None, None


def _kernel_grads(v: Tensor, g: Tensor, kyl: Tensor, kx: Tensor, grid, need_kyl: bool, need_kx: bool):
    """Gradients of ``sum(g * mix(v))`` with respect to ``kyl (H, R, Gh, Gh)`` and ``kx (H, R, Gw, Gw)``, one head at
    a time by ``head_grads`` (in ``v``'s dtype; half-precision kernels get float32 gradients, cast back at the end)."""
    gh, gw = grid
    b, _, d = v.shape
    h, r = kyl.shape[:2]
    dh = d // h
    vp = v.reshape(b, gh, gw, h, dh)
    gp = g.reshape(b, gh, gw, h, dh)
    kx_stack = kx.to(v.dtype).reshape(h, r * gw, gw)
    ky_fold = kyl.to(v.dtype).permute(0, 2, 3, 1).reshape(h, gh, gh * r)  # columns (jy, r), as the torch backend's
    g_kyl = torch.zeros_like(kyl) if need_kyl else None
    g_kx = torch.zeros(kx.shape, dtype=torch.float32 if kx.dtype in (torch.float16, torch.bfloat16) else kx.dtype,
                       device=kx.device) if need_kx else None
    for hh in range(h):
        g_ky_h, g_kx_h, _ = head_grads(
            vp[:, :, :, hh].reshape(b * gh, gw, dh), gp[:, :, :, hh].reshape(b, gh, gw * dh), kx_stack[hh],
            ky_fold[hh], need_ky=need_kyl, need_kx=need_kx, need_v=False, acc_dtype=kyl.dtype,
        )
        if need_kyl:
            g_kyl[hh] = g_ky_h.view(gh, gh, r).permute(2, 0, 1)
        if need_kx:
            g_kx[hh] = g_kx_h.view(r, gw, gw).to(g_kx.dtype)
    if need_kx:
        g_kx = g_kx.to(kx.dtype)
    return g_kyl, g_kx
