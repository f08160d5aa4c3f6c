"""The SSoG operator as functions of tensors (docs/operator.md): the maths of ``ssogvit.core`` (re-exported here) and
the mixing, checked and handed to the backend that one ordered probe picks (docs/operator.md, "Backends").

Every backend (``ssogvit.backends.cpu``, ``.triton``, ``.torch``; ``"einsum"`` is ``core``'s own path) has the same
entry points, pure functions of tensors: ``fixed_forward``, ``fixed_backward``, ``steered_forward``,
``steered_backward`` and ``unsupported`` (its probe). This module wires them into autograd once for all of them:
``_FixedMix`` and ``_SteeredMix``. A backward that builds a graph (``create_graph=True``, a gradient penalty) is the
einsum path's, which autograd can differentiate again. Every call into a backend goes where ``backend_for``, the one
probe, says, the C kernel's own field ops too.

Each public function checks its arguments (the grid against the values, the shapes) once, at entry; the private
functions behind it (``_mix_fixed``, ``_steered``) trust their caller and check nothing again.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import Tensor

from ssogvit import core
from ssogvit.backends import cpu, triton
from ssogvit.backends import torch as stacked
from ssogvit.backends._common import graph_grads
from ssogvit.core import (
    check_grid, field_sigma, field_tau, functional_only, gaussian_rows, kernel_scale, output_geometry, position_dtype,
    prefix_pool, steer_gate, steered_geometry, steering_outputs, token_geometry,
)

__all__ = [
    "SSOG_IMPLS",
    "axis_kernels",
    "backend_for",
    "check_grid",
    "field_sigma",
    "field_tau",
    "functional_only",
    "gaussian_rows",
    "kernel_scale",
    "position_dtype",
    "prefix_pool",
    "ssog_mix",
    "ssog_mix_field",
    "ssog_mix_steered",
    "ssog_mix_steered_by_tokens",
    "steer_gate",
    "steered_geometry",
    "token_geometry",
]

#: Implementations of both mixings (docs/operator.md, "Backends"): ``"cpu"`` the C kernel, ``"triton"`` the fused GPU
#: kernel (fixed mixing only), ``"stacked"`` the torch backend's batched matmuls, ``"einsum"`` the readable path of
#: ``ssogvit.core``; ``"auto"`` the first of ``AUTO_ORDER`` that takes the input.
SSOG_IMPLS = ("auto", "cpu", "triton", "stacked", "einsum")
_BACKENDS = {"cpu": cpu, "triton": triton, "stacked": stacked}
#: The probe's order for ``impl="auto"``: Triton where it applies (CUDA), the C kernel on the CPU, else the torch
#: backend, which takes anything.
AUTO_ORDER = ("triton", "cpu", "stacked")


def backend_for(kind: str, impl: str, values: Tensor, *operands: Tensor) -> str:
    """The implementation that mixes ``values`` with ``operands`` (``kind`` is ``"fixed"``, operands ``ky, kx, lam``;
    or ``"steered"``, operands the geometry's inputs; or one of the C kernel's own field ops, ``"field"``, operands
    ``mu, sigma, lam``, and ``"tables"``, operands ``mu, sigma``): ``impl`` itself when asked for by name (a
    ``RuntimeError`` with the reason where it cannot), else the first of ``AUTO_ORDER`` whose probe takes it. Under
    tracing and export (``core.functional_only``) ``"auto"`` and ``"stacked"`` are ``"einsum"``: no writes into
    buffers there. The one probe: every call into a backend goes where this says."""
    _check_impl(impl)
    if impl == "einsum" or (impl in ("auto", "stacked") and functional_only()):
        return "einsum"
    if impl != "auto":
        reason = _BACKENDS[impl].unsupported(kind, values, *operands, auto=False)
        if reason is not None:
            raise RuntimeError(reason)
        return impl
    return next(name for name in AUTO_ORDER if _BACKENDS[name].unsupported(kind, values, *operands, auto=True) is None)


def _check_impl(impl: str) -> None:
    if impl not in SSOG_IMPLS:
        raise ValueError(f"unknown SSoG implementation {impl!r}; expected one of {SSOG_IMPLS}")


def _c_field_op(kind: str, impl: str, values: Tensor, *operands: Tensor) -> bool:
    """Whether the C kernel's own op of ``kind`` (``"tables"``: ``axis_kernels``; ``"field"``: ``ssog_mix_field``)
    takes the call: ``impl`` is ``"auto"`` or ``"cpu"`` and ``backend_for(kind, "auto", ...)`` picks the C backend.
    Elsewhere ``core``'s operations build the same tables, never an error here: a mixing asked for by name that
    cannot run says so itself (``ssog_mix``)."""
    _check_impl(impl)
    return impl in ("auto", "cpu") and backend_for(kind, "auto", values, *operands) == "cpu"


def axis_kernels(length: int, mu: Tensor, sigma: Tensor, tau: Tensor | float, *, impl: str = "auto") -> Tensor:
    """``core.axis_kernels`` (arguments as there), by the C kernel where ``impl`` (``"auto"`` or ``"cpu"``) lets it
    and it takes the field (float32 or float64 CPU tensors of one shape; not under tracing or export), else by
    ``core``'s torch operations. ``impl`` names the implementation of the mixing the tables are for
    (``SSOG_IMPLS``)."""
    if _c_field_op("tables", impl, mu, sigma):
        scale = kernel_scale(sigma, torch.as_tensor(tau, device=mu.device))
        if scale.shape == mu.shape:
            return cpu.axis_kernels(length, mu, scale)
    return core.axis_kernels(length, mu, sigma, tau)


def _check_inplace(name: str, inplace: bool, grad_needed: bool) -> None:
    if inplace and grad_needed:
        raise ValueError(f"{name}(inplace=True) overwrites the values, which autograd needs: use it without grad")
    if inplace and functional_only():
        raise ValueError(f"{name}(inplace=True) cannot be traced or exported: the graph would lose the aliasing")


def _grad_needed(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------------------
# Fixed mixing


def ssog_mix(
    values: Tensor,
    grid: tuple[int, int],
    ky: Tensor,
    kx: Tensor,
    lam: Tensor,
    *,
    impl: str = "auto",
    inplace: bool = False,
    head_chunk: int | None = None,
    bands: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Separable fixed-SSoG mixing of all tokens (docs/operator.md, "Fixed mixing"): prefix tokens get the mean patch
    value, patches

    ``Y_h[iy, ix] = sum_r lam[h, r] sum_{jy, jx} ky[h, r, iy, jy] kx[h, r, ix, jx] V_h[jy, jx]``.

    Args:
        values: values of all tokens ``(B, P + N, D)``, prefix first, patches in raster order (``N = Gh * Gw``).
        grid: ``(Gh, Gw)``.
        ky: y-axis kernels ``(H, R, Gh, Gh)``.
        kx: x-axis kernels ``(H, R, Gw, Gw)``.
        lam: mixture weights ``(H, R)``.
        impl: one of ``SSOG_IMPLS``; ``"auto"``: ``"triton"`` on CUDA tensors in float16 or bfloat16, and in float32
            where TF32 is on, when Triton imports, the kernel passed its probe on the device and its tiles fit;
            ``"cpu"`` on CPU float32 and float64 tensors where the C kernel is available; ``"stacked"`` otherwise.
        inplace: let the mixing overwrite ``values`` (inference only: an error if autograd would need them), one
            activation-sized buffer less (``"triton"`` and ``"einsum"`` ignore it).
        head_chunk: heads mixed together by ``"stacked"``'s forward (one batched matmul per pass for the chunk instead
            of one per head). ``None`` picks by size (``backends.torch.default_mix_head_chunk``).
        bands: the bands of the tables' rows, ``(H, R, Gh, 2)`` and ``(H, R, Gw, 2)`` (``core.field_bands`` of the
            field the tables come from), or ``None``: in inference the C kernel then reads only the bands, where
            that is faster (docs/operator.md, "Bands"). Tables that are not a field's rows must not be given bands.

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    grid = check_grid(values.shape[1], grid)[:2]
    h, r = lam.shape if lam.ndim == 2 else (0, 0)  # no heads: refused below
    if not h or ky.shape != (h, r, grid[0], grid[0]) or kx.shape != (h, r, grid[1], grid[1]) or values.shape[-1] % h:
        raise ValueError(f"expected ky (H, R, Gh, Gh), kx (H, R, Gw, Gw) and lam (H, R) for the grid {grid} with H "
                         f"dividing the values' width {values.shape[-1]}, got {tuple(ky.shape)}, {tuple(kx.shape)} "
                         f"and {tuple(lam.shape)}")
    return _mix_fixed(values, grid, ky, kx, lam, impl, inplace, head_chunk, bands)


def _mix_fixed(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, impl: str, inplace: bool,
               head_chunk: int | None, bands: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``ssog_mix`` after its checks: it trusts its caller for the grid (ints, fitting the values) and the shapes."""
    grad_needed = _grad_needed(values, ky, kx, lam)
    _check_inplace("ssog_mix", inplace, grad_needed)
    name = backend_for("fixed", impl, values, ky, kx, lam)
    if name == "einsum":
        return core.mix_fixed(values, grid, ky, kx, lam)
    if grad_needed:
        return _FixedMix.apply(values, ky, kx, lam, grid, name, head_chunk)
    banded = {"bands": bands} if name == "cpu" and bands is not None else {}  # the C kernel's alone
    return _BACKENDS[name].fixed_forward(values, grid, ky, kx, lam, inplace=inplace, head_chunk=head_chunk, **banded)


def ssog_mix_field(
    values: Tensor,
    grid: tuple[int, int],
    mu: Tensor,
    sigma: Tensor,
    lam: Tensor,
    tau: Tensor,
    *,
    impl: str = "auto",
    inplace: bool = False,
    head_chunk: int | None = None,
) -> Tensor:
    """``ssog_mix`` of a fixed field's own tables (``axis_kernels`` of each axis; docs/operator.md, "Fixed mixing"),
    with autograd to the field: what a training step calls. The C kernel takes the field itself, one op each way
    (``impl`` ``"auto"`` or ``"cpu"`` where it takes the tensors, and not ``inplace``); every other implementation
    mixes the tables ``axis_kernels`` builds.

    Args:
        values: ``(B, P + N, D)``, as ``ssog_mix``'s.
        grid: ``(Gh, Gw)``.
        mu, sigma: centres and widths ``(H, R, 2)``, axis order ``(y, x)``.
        lam: mixture weights ``(H, R)``.
        tau: temperature, a scalar tensor or ``(H,)``.
        impl, inplace, head_chunk: as ``ssog_mix``'s.
    """
    gh, gw, _ = check_grid(values.shape[1], grid)
    h, r = lam.shape if lam.ndim == 2 else (0, 0)  # no heads: refused below
    if (not h or mu.shape != (h, r, 2) or sigma.shape != mu.shape or tau.shape not in ((), (h,))
            or values.shape[-1] % h):
        raise ValueError(f"expected mu and sigma (H, R, 2), lam (H, R) and tau () or (H,) with H dividing the values' "
                         f"width {values.shape[-1]}, got {tuple(mu.shape)}, {tuple(sigma.shape)}, {tuple(lam.shape)} "
                         f"and {tuple(tau.shape)}")
    tau = tau[:, None] if tau.ndim else tau  # against (H, R)
    if not inplace and _c_field_op("field", impl, values, mu, sigma, lam):
        return cpu.field_mix(values, (gh, gw), mu, kernel_scale(sigma, tau[..., None]), lam)
    ky = axis_kernels(gh, mu[..., 0], sigma[..., 0], tau, impl=impl).to(values.dtype)
    kx = axis_kernels(gw, mu[..., 1], sigma[..., 1], tau, impl=impl).to(values.dtype)
    return _mix_fixed(values, (gh, gw), ky, kx, lam.to(values.dtype), impl, inplace, head_chunk)


class _FixedMix(torch.autograd.Function):
    """The fixed mixing by a backend, with its backward: saves the values and the tables only (the backends recompute
    the x-pass)."""

    @staticmethod
    def forward(ctx, values, ky, kx, lam, grid, impl, head_chunk):
        ctx.save_for_backward(values, ky, kx, lam)
        ctx.grid, ctx.impl = grid, impl
        return _BACKENDS[impl].fixed_forward(values, grid, ky, kx, lam, head_chunk=head_chunk)

    @staticmethod
    def backward(ctx, grad):
        values, ky, kx, lam = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate again
            grads = graph_grads(lambda *a: core.mix_fixed(a[0], ctx.grid, *a[1:]), (values, ky, kx, lam), grad)
        else:
            grads = _BACKENDS[ctx.impl].fixed_backward(grad, values, ctx.grid, ky, kx, lam)
        return *grads, None, None, None


# ---------------------------------------------------------------------------------------------------------------------
# Steered mixing


def _tau_per_head(tau: Tensor) -> Tensor:
    return tau.reshape(-1).view(1, 1, -1, 1, 1)  # scalar or (H,), against (B, N, H, R, 2)


def _given_geometry(mu: Tensor, sigma: Tensor, lam: Tensor, tau: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return mu, kernel_scale(sigma, _tau_per_head(tau)), lam


def _output_geometry(*inputs: Tensor, size: tuple[int, int], steer: tuple[str, ...], radius: float
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The geometry from ``(*outputs, mu, sigma, ell, tau, *alphas)``, the steering maps' outputs first."""
    k = len(steer)
    mu, sigma, ell, tau = inputs[k:k + 4]
    mu, sigma, lam = output_geometry(inputs[:k], mu, sigma, ell, inputs[k + 4:], size=size, steer=steer, radius=radius)
    return mu, kernel_scale(sigma, _tau_per_head(tau)), lam


def ssog_mix_steered(
    values: Tensor,
    grid: tuple[int, int],
    mu: Tensor,
    sigma: Tensor,
    lam: Tensor,
    tau: Tensor,
    *,
    impl: str = "auto",
    head_chunk: int | None = None,
    inplace: bool = False,
) -> Tensor:
    """Separable mixing with per-token geometry (docs/operator.md, "Steered mixing").

    Column pass ``U_r[iy, k] = sum_jy K^y(g_(iy,k))[r, iy, jy] V[jy, k]`` (steered by the token at ``(iy, k)``),
    row pass ``Y[iy, ix] = sum_r lam_(iy,ix)[r] sum_k K^x(g_(iy,ix))[r, ix, k] U_r[iy, k]`` (steered by the query).

    Args:
        values: values of all tokens ``(B, P + N, D)``; prefix tokens get the mean patch value.
        grid: ``(Gh, Gw)``.
        mu: per-token centres ``(B, N, H, R, 2)``, axis order ``(y, x)``.
        sigma: per-token widths ``(B, N, H, R, 2)``.
        lam: per-token mixture weights ``(B, N, H, R)``.
        tau: temperature, a scalar tensor or ``(H,)``.
        impl: one of ``SSOG_IMPLS`` but ``"triton"``; ``"auto"``: ``"cpu"`` on CPU float32 and float64 tensors where the
            C kernel is available, ``"stacked"`` otherwise.
        head_chunk: heads processed together by ``"stacked"``; bounds the per-token kernel tables to
            ``B * N * head_chunk * R * (Gh + Gw)`` entries. ``None`` = all heads at once.
        inplace: write the result over ``values`` and return it (inference only: an error if autograd would need
            ``values``).

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    grid = _check_geometry(values, grid, mu, sigma, lam)
    return _steered(values, grid, _given_geometry, (mu, sigma, lam, tau), impl, head_chunk, inplace)


def ssog_mix_steered_by_tokens(
    values: Tensor,
    grid: tuple[int, int],
    tokens: Tensor,
    mu: Tensor,
    sigma: Tensor,
    ell: Tensor,
    tau: Tensor,
    *steering: Tensor,
    steer: tuple[str, ...],
    radius: float,
    impl: str = "auto",
    head_chunk: int | None = None,
    inplace: bool = False,
) -> Tensor:
    """``ssog_mix_steered`` of the geometry the patch tokens predict (``core.token_geometry``; arguments as there;
    ``tokens`` the patch tokens ``(B, N, D)`` or all tokens ``(B, P + N, D)``, whose prefix rows are not read).
    With autograd the steering maps' outputs (``5 H R`` numbers per token at most) are kept for backward, the
    geometry from them is not: it is recomputed there (``SSoGAttention`` passes its normalised tokens, which its value
    projection keeps anyway, and its parameters)."""
    grid = check_grid(values.shape[1], grid)[:2]
    size = (values.shape[0], grid[0] * grid[1])
    if tokens.ndim != 3 or tokens.shape[0] != size[0] or tokens.shape[1] not in (size[1], values.shape[1]):
        raise ValueError(f"tokens must be the patch tokens (B, N, D) = ({size[0]}, {size[1]}, D) or all tokens "
                         f"(B, P + N, D) = ({size[0]}, {values.shape[1]}, D), got {tuple(tokens.shape)}")
    k = len(steer)  # the maps' matmuls are autograd's (docs/operator.md, "Backward")
    outputs = [a[:, a.shape[1] - size[1]:] for a in steering_outputs(tokens, *steering[k:])]
    geometry = functools.partial(_output_geometry, size=size, steer=tuple(steer), radius=float(radius))
    return _steered(values, grid, geometry, (*outputs, mu, sigma, ell, tau, *steering[:k]), impl, head_chunk, inplace)


def _check_geometry(values: Tensor, grid: tuple[int, int], mu: Tensor, sigma: Tensor, lam: Tensor
                    ) -> tuple[int, int]:
    """The grid ``(Gh, Gw)`` checked against the values, and the given geometry's shapes against both."""
    gh, gw, _ = check_grid(values.shape[1], grid)
    expected = (values.shape[0], gh * gw)
    for name, t in (("mu", mu), ("sigma", sigma), ("lam", lam)):
        if tuple(t.shape[:2]) != expected:
            raise ValueError(f"{name} must have one row per patch token, shape (B, N, ...) = {expected} + ..., "
                             f"got {tuple(t.shape)}")
    if mu.ndim != 5 or mu.shape[-1] != 2 or sigma.shape != mu.shape or lam.shape != mu.shape[:-1]:
        raise ValueError(f"expected mu and sigma of shape (B, N, H, R, 2) and lam of shape (B, N, H, R), got "
                         f"{tuple(mu.shape)}, {tuple(sigma.shape)} and {tuple(lam.shape)}")
    if values.shape[-1] % mu.shape[2]:
        raise ValueError(f"the values' width {values.shape[-1]} is not divisible by the geometry's {mu.shape[2]} heads")
    return gh, gw


def _steered(values: Tensor, grid: tuple[int, int], geometry, inputs: tuple[Tensor, ...], impl: str,
             head_chunk: int | None, inplace: bool) -> Tensor:
    """The steered mixing after the entry point's checks: it trusts its caller for the grid (ints, fitting the
    values) and the shapes."""
    grad_needed = _grad_needed(values, *inputs)
    _check_inplace("ssog_mix_steered", inplace, grad_needed)
    name = backend_for("steered", impl, values, *inputs)
    if name == "einsum":
        return core.mix_steered(values, grid, *geometry(*inputs))
    if grad_needed:
        return _SteeredMix.apply(values, grid, name, head_chunk, geometry, *inputs)
    return _BACKENDS[name].steered_forward(values, grid, *geometry(*inputs), inplace=inplace, head_chunk=head_chunk)


class _SteeredMix(torch.autograd.Function):
    """The steered mixing by a backend, keeping for backward only the values and what the geometry is a function of
    (``geometry(*inputs) -> (mu, scale, lam)``, a pure function of ``ssogvit.core``): backward recomputes the geometry
    under the forward's autocast and differentiates it with ``torch.func.vjp``."""

    @staticmethod
    def forward(ctx, values, grid, impl, head_chunk, geometry, *inputs):
        ctx.save_for_backward(values, *inputs)
        ctx.args = (grid, impl, head_chunk, geometry)
        ctx.autocast = _autocast_state()  # the recomputed geometry must be the one the forward used
        return _BACKENDS[impl].steered_forward(values, grid, *geometry(*inputs), head_chunk=head_chunk)

    @staticmethod
    def backward(ctx, grad):
        values, *inputs = ctx.saved_tensors
        grid, impl, head_chunk, geometry = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate again
            with _autocast(ctx.autocast):
                grads = graph_grads(lambda v, *a: core.mix_steered(v, grid, *geometry(*a)), (values, *inputs), grad)
        else:
            with _autocast(ctx.autocast):
                geo, geometry_vjp = _vjp(geometry, inputs)
            g_values, *g_geo = _BACKENDS[impl].steered_backward(grad, values, grid, *geo, head_chunk=head_chunk)
            del geo
            grads = [g_values, *geometry_vjp(tuple(g_geo))]
        return grads[0], None, None, None, None, *grads[1:]


def _vjp(fn, inputs: tuple[Tensor, ...]):
    """``torch.func.vjp(fn, *inputs)`` where a compiler traces it; in eager the same by autograd on detached copies of
    the inputs, whose dispatch costs less (0.4 ms of a steered ViT-B layer's backward at 224 px, one thread)."""
    if torch.compiler.is_compiling():
        return torch.func.vjp(fn, *inputs)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        outputs = fn(*leaves)

    def vjp(cotangents: tuple[Tensor, ...]) -> list[Tensor | None]:
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
                     if wanted and pairs else [None] * len(wanted))
        return [next(found) if leaf.requires_grad else None for leaf in leaves]

    return [o.detach() for o in outputs], vjp


def _autocast_state() -> tuple[bool, torch.dtype, bool, torch.dtype]:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"))


@contextmanager
def _autocast(state: tuple[bool, torch.dtype, bool, torch.dtype]):
    """Autocast as it was in the forward (backward runs outside the caller's ``torch.autocast`` block)."""
    cpu_on, cpu_dtype, cuda_on, cuda_dtype = state
    with torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_on), torch.autocast("cuda", dtype=cuda_dtype,
                                                                                 enabled=cuda_on):
        yield
