"""Functional core of SSoG: Gaussian axis kernels and the separable mixing they define (docs/operator.md).

Everything here is a function of plain tensors. Shapes use these letters:

    B batch, H heads, R atoms, dh head width, D = H * dh,
    Gh x Gw patch grid, N = Gh * Gw patch tokens in row-major raster order, P prefix tokens.

The N x N mixing matrix is never built here; ``ssogvit.reference`` does that for tests and diagnostics.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from ssogvit.backends import torch as torch_backend
from ssogvit.backends import triton as triton_backend
from ssogvit.backends._common import flush_tiny, functional_only, gaussian_rows_grad, grid_offsets, prefix_pool

__all__ = [
    "SSOG_IMPLS",
    "axis_kernels",
    "check_grid",
    "field_sigma",
    "field_tau",
    "functional_only",
    "position_dtype",
    "prefix_pool",
    "ssog_mix",
    "ssog_mix_steered",
    "ssog_mix_steered_from",
    "steer_gate",
    "steered_geometry",
    "token_axis_kernels",
    "kernel_scale",
    "gaussian_rows",
]

#: Implementations of the fixed separable contraction (docs/operator.md, "Backends"). ``"auto"`` picks one by device,
#: dtype and problem size. ``"triton"``: the fused kernel of ``ssogvit.backends.triton`` (CUDA; ``"auto"`` picks it in
#: half precision, and in float32 with TF32 on, when Triton imports and the kernel passed its probe on the device).
SSOG_IMPLS = ("auto", "stacked", "loop", "einsum", "triton")


def _grid_side(g: object) -> int:
    if isinstance(g, torch.SymInt):  # traced / exported with a dynamic image size
        return g  # type: ignore[return-value]
    if isinstance(g, bool) or not hasattr(g, "__index__"):
        raise TypeError
    return operator.index(g)  # ints, numpy ints and integer tensors; 4.9 or 4.0 is an error, never truncated


def check_grid(
    num_tokens: int, grid: tuple[int, int], num_prefix_tokens: int | None = None, *,
    max_implicit_prefix: int | None = None,
) -> tuple[int, int, int]:
    """Validate a grid against a token count; returns ``(Gh, Gw, num_prefix_tokens)``.

    Args:
        num_tokens: ``T``, the length of the token sequence.
        grid: ``(Gh, Gw)``, two positive integers (a float, even a whole one, is an error, never truncated).
        num_prefix_tokens: ``P`` when the caller knows it (every model does): then ``T`` must be exactly
            ``P + Gh * Gw``. ``None`` takes ``P = T - Gh * Gw`` (``P >= 0``, at most ``max_implicit_prefix``).
        max_implicit_prefix: the largest ``P`` taken without ``num_prefix_tokens`` (``None``: any). The mixers' own
            calls take 1 (no class token, or one): any other count must be given, so that a grid too small for the
            tokens is an error, never patches taken for prefix tokens.
    """
    try:
        gh, gw = (_grid_side(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (Gh, Gw) of positive ints, got {grid!r}") from None
    if gh < 1 or gw < 1:
        raise ValueError(f"grid must be a pair (Gh, Gw) of positive ints, got {grid!r}")
    prefix = num_tokens - gh * gw
    if num_prefix_tokens is not None:
        if prefix != num_prefix_tokens:
            raise ValueError(
                f"token count {num_tokens} does not fit the grid: expected P + Gh*Gw = {num_prefix_tokens} + "
                f"{gh}*{gw} = {num_prefix_tokens + gh * gw} tokens (P={num_prefix_tokens} prefix tokens, Gh={gh}, "
                f"Gw={gw})"
            )
    elif prefix < 0:
        raise ValueError(
            f"token count {num_tokens} does not fit the grid: expected P + Gh*Gw tokens with Gh={gh}, Gw={gw} "
            f"(Gh*Gw={gh * gw}) and P >= 0 prefix tokens"
        )
    elif max_implicit_prefix is not None and prefix > max_implicit_prefix:
        raise ValueError(
            f"token count {num_tokens} does not fit the grid: Gh*Gw = {gh}*{gw} = {gh * gw} patch tokens leave "
            f"{prefix} prefix tokens; without num_prefix_tokens at most {max_implicit_prefix} (a class token) "
            f"is taken, so pass num_prefix_tokens={prefix} if there are {prefix} (class and register tokens), or "
            "the right grid"
        )
    return gh, gw, prefix


def position_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels are built in: at least float32, so that grid positions above 256 (bfloat16) or 2048
    (float16) stay exact integers; float64 stays float64. The tables are cast to the values' dtype afterwards."""
    return torch.promote_types(dtype, torch.float32)


def field_sigma(rho: Tensor, sigma_min: float, eps_sigma: float) -> Tensor:
    """Width ``sigma = sigma_min + softplus(rho) + eps_sigma``, in grid cells (docs/operator.md, "Parameterisation")."""
    return sigma_min + F.softplus(rho) + eps_sigma


def field_tau(theta: Tensor, tau_min: float) -> Tensor:
    """Temperature ``tau = tau_min + softplus(theta)`` (docs/operator.md, "Parameterisation")."""
    return tau_min + F.softplus(theta)


def steer_gate(alpha: Tensor) -> Tensor:
    """Steering gate ``s = softplus(alpha) + 1e-4`` (docs/operator.md, "Steering geometry")."""
    return F.softplus(alpha) + 1e-4


def axis_kernels(length: int, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """Row-softmax Gaussian kernels along one grid axis (docs/operator.md, "Axis kernels").

    ``K[..., i, j] = softmax_j( -(j - i - mu)^2 / (2 sigma^2 tau) )`` over the ``length`` positions inside the grid.

    Args:
        length: axis length ``L`` (``Gh`` or ``Gw``).
        mu: atom centres along this axis, any shape ``S`` (e.g. ``(H, R)``), in grid cells.
        sigma: widths, shape ``S``.
        tau: temperature, broadcastable to ``S``.

    Returns:
        Kernels of shape ``S + (L, L)`` in ``position_dtype(mu.dtype)``; each row sums to 1.
    """
    dtype = position_dtype(mu.dtype)
    delta = grid_offsets(length, dtype, mu.device)  # (L, L): source j minus query i, exact integers
    scale = kernel_scale(sigma, torch.as_tensor(tau, device=mu.device))
    return gaussian_rows(delta, mu.to(dtype)[..., None, None], scale[..., None, None])


def kernel_scale(sigma: Tensor, tau: Tensor) -> Tensor:
    """``s = 1 / (sigma sqrt(2 tau))``, so that a kernel's logit ``-(d - mu)^2 / (2 sigma^2 tau)`` is
    ``-((d - mu) s)^2``; in ``position_dtype`` (docs/operator.md, "Axis kernels")."""
    dtype = position_dtype(sigma.dtype)
    return torch.rsqrt(2.0 * tau.to(dtype)) / sigma.to(dtype)


def gaussian_rows(delta: Tensor, mu: Tensor, scale: Tensor, *, inplace: bool | None = None) -> Tensor:
    """Kernel rows ``K[..., j] = softmax_j(-((delta_j - mu) * scale)^2)``, denormal entries set to zero (docs/operator.md,
    "Axis kernels", "Denormals"): the one evaluation of the Gaussian kernel, for the fixed and the steered field.

    Args:
        delta: source minus query position ``j - i`` (exact integers, in ``position_dtype``), broadcastable to the
            result; its last axis is the row.
        mu, scale: centres and ``kernel_scale``, broadcastable to the result with a trailing axis of size 1.
        inplace: build the table in one buffer, updated in place (inference). ``None``: whenever autograd and tracing
            allow it.

    Returns:
        Rows of the broadcast shape. With autograd, ``_GaussianRows`` keeps the rows, ``mu`` and ``scale`` for
        backward (one table, not the four a plain graph keeps).
    """
    grad = torch.is_grad_enabled() and (mu.requires_grad or scale.requires_grad)
    if grad and not functional_only():
        return _GaussianRows.apply(delta, mu, scale)
    if inplace is None:
        inplace = not grad and not functional_only()
    if inplace:  # three passes over one buffer: subtract, square, scale by -s^2
        logits = torch.sub(delta, mu).square_().mul_(-scale.square())
    else:
        logits = -((delta - mu) * scale).square()
    return flush_tiny(torch.softmax(logits, dim=-1))


class _GaussianRows(torch.autograd.Function):
    """``gaussian_rows`` with autograd: saves the rows (and the small ``mu``, ``scale``); backward recomputes
    ``delta - mu`` (``backends._common.gaussian_rows_grad``)."""

    @staticmethod
    def forward(ctx, delta: Tensor, mu: Tensor, scale: Tensor) -> Tensor:
        with torch.no_grad():
            rows = gaussian_rows(delta, mu, scale, inplace=True)
        ctx.save_for_backward(delta, mu, scale, rows)
        return rows

    @staticmethod
    def backward(ctx, g_rows: Tensor):
        delta, mu, scale, rows = ctx.saved_tensors
        g_mu, g_scale = gaussian_rows_grad(rows, delta - mu, scale, g_rows)
        return None, g_mu.sum_to_size(mu.shape), g_scale.sum_to_size(scale.shape)


def token_axis_kernels(length: int, query: Tensor, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """Per-token kernel rows along one axis (steered SSoG): ``K[..., j] = softmax_j(-(j - q - mu)^2 / (2 s^2 tau))``.

    Args:
        length: axis length ``L``.
        query: the query index ``q`` along the axis (an integer tensor), broadcastable to ``mu``'s shape.
        mu, sigma: per-token geometry, shape ``S``.
        tau: temperature, broadcastable to ``S``.

    Returns:
        Kernel rows of shape ``S + (L,)`` in ``position_dtype(mu.dtype)``.
    """
    dtype = position_dtype(mu.dtype)
    delta = torch.arange(length, device=mu.device) - torch.as_tensor(query, device=mu.device)[..., None]  # j - q
    scale = kernel_scale(sigma, torch.as_tensor(tau, device=mu.device))
    return gaussian_rows(delta.to(dtype), mu.to(dtype)[..., None], scale[..., None])


def steered_geometry(
    mu: Tensor,
    sigma: Tensor,
    ell: Tensor,
    residuals: Mapping[str, Tensor],
    gates: Mapping[str, Tensor],
    *,
    radius: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token geometry of steered SSoG (docs/operator.md, "Steering geometry"):
    ``mu_n = mu + s_mu M tanh(a_mu)``, ``sigma_n = sigma exp(s_sigma tanh(a_sigma))``,
    ``lambda_n = softmax(ell + s_lambda tanh(a_lambda))`` for token ``n``; a path without a residual keeps the fixed field.

    Args:
        mu: fixed centres ``(H, R, 2)``, or already broadcast to ``(B, N, H, R, 2)``.
        sigma: fixed widths, same shape as ``mu``.
        ell: mixture logits ``(H, R)``, or ``(B, N, H, R)``.
        residuals: the raw outputs ``a`` of the steering maps by path (``"mu"``, ``"sigma"``, ``"lambda"``), shaped
            ``(B, N, H, R, 2)`` for centres and widths, ``(B, N, H, R)`` for the mixture.
        gates: the gate values ``s`` by path (scalars).
        radius: the steering radius ``M`` in grid cells.

    Returns:
        ``mu (B, N, H, R, 2)``, ``sigma (B, N, H, R, 2)``, ``lambda (B, N, H, R)`` where every path is steered (else
        the fixed field's shape, broadcastable to them).
    """
    if "mu" in residuals:
        mu = mu + gates["mu"] * radius * torch.tanh(residuals["mu"])
    if "sigma" in residuals:
        sigma = sigma * torch.exp(gates["sigma"] * torch.tanh(residuals["sigma"]))
    if "lambda" in residuals:
        ell = ell + gates["lambda"] * torch.tanh(residuals["lambda"])
    # the softmax over the R atoms is taken across the second-to-last axis of a transposed view: the same function
    # (equal to rounding), and on the CPU 3x to 5x faster than across a last axis this short (docs/benchmarks.md,
    # "Steered SSoG against fused attention")
    return mu, sigma, torch.softmax(ell.transpose(-1, -2), dim=-2).transpose(-1, -2)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch (docs/operator.md, "Backends")


def _check_inplace(name: str, inplace: bool, grad_needed: bool) -> None:
    if inplace and grad_needed:
        raise ValueError(f"{name}(inplace=True) overwrites the values, which autograd needs: use it without grad")
    if inplace and functional_only():
        raise ValueError(f"{name}(inplace=True) cannot be traced or exported: the graph would lose the aliasing")


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
        impl: ``"stacked"`` (atoms stacked inside one matmul per pass and head, lambda folded into the y-kernels,
            a custom autograd function that saves only the values and recomputes the rest: the default),
            ``"loop"`` (one atom at a time, head-major layout), ``"einsum"`` (plain, the benchmarks' baseline),
            ``"triton"`` (fused kernel, CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (``"triton"`` on
            CUDA tensors in float16 or bfloat16, and in float32 where TF32 is on, when Triton imports, the kernel
            passed its probe on the device and its tiles fit; on the CPU without autograd, float32 or float64, the
            C kernel of ``backends.cpu`` where it is available; ``"stacked"`` otherwise).
        inplace: let the mixing overwrite ``values`` (inference only: an error if autograd would need them).
            ``"stacked"`` then writes its result into ``values``' buffer, one activation-sized buffer less: each
            head's values are read for the last time before its result is written. The other implementations
            ignore it.
        head_chunk: heads mixed together by ``"stacked"`` (one batched matmul per pass for the chunk instead of one
            per head). ``None`` picks by size: chunks of ``H // (R + 2)`` heads (their temporaries stay within one
            activation) where ``B * N`` is small enough that per-head matmuls are too small to use both cores, one
            head at a time otherwise.

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    grad_needed = torch.is_grad_enabled() and any(t.requires_grad for t in (values, ky, kx, lam))
    _check_inplace("ssog_mix", inplace, grad_needed)
    grid = check_grid(values.shape[1], grid)[:2]
    h, r = lam.shape if lam.ndim == 2 else (0, 0)  # no heads: refused below
    if not h or ky.shape != (h, r, grid[0], grid[0]) or kx.shape != (h, r, grid[1], grid[1]) or values.shape[-1] % h:
        raise ValueError(f"expected ky (H, R, Gh, Gh), kx (H, R, Gw, Gw) and lam (H, R) for the grid {grid} with H "
                         f"dividing the values' width {values.shape[-1]}, got {tuple(ky.shape)}, {tuple(kx.shape)} "
                         f"and {tuple(lam.shape)}")
    if impl not in SSOG_IMPLS:
        raise ValueError(f"unknown SSoG implementation {impl!r}; expected one of {SSOG_IMPLS}")
    if impl in ("auto", "stacked") and functional_only():
        impl = "einsum"  # no writes into a preallocated output (see functional_only)
    if impl == "triton" or (
        impl == "auto" and values.is_cuda and triton_backend.auto_picks_triton(values, grid, lam.shape[1])
    ):
        return triton_backend.ssog_mix_triton(values, grid, ky, kx, lam)  # imports Triton on first use only
    return torch_backend.mix_fixed(
        values, grid, ky, kx, lam, impl=impl, inplace=inplace, head_chunk=head_chunk, grad_needed=grad_needed,
        rows=gaussian_rows,
    )


def ssog_mix_steered(
    values: Tensor,
    grid: tuple[int, int],
    mu: Tensor,
    sigma: Tensor,
    lam: Tensor,
    tau: Tensor,
    *,
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
        head_chunk: heads processed together; bounds the per-token kernel tables to
            ``B * N * head_chunk * R * (Gh + Gw)`` entries. ``None`` = all heads at once.
        inplace: write the result over ``values`` and return it (inference only: an error if autograd would need
            ``values``); each chunk's values are read for the last time before its result is written.

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    return ssog_mix_steered_from(values, grid, _given, (mu, sigma, lam, tau), head_chunk=head_chunk, inplace=inplace)


def _given(*geometry: Tensor) -> tuple[Tensor, ...]:
    return geometry


def ssog_mix_steered_from(
    values: Tensor,
    grid: tuple[int, int],
    geometry: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]],
    inputs: tuple[Tensor, ...],
    *,
    head_chunk: int | None = None,
    inplace: bool = False,
) -> Tensor:
    """``ssog_mix_steered`` of the geometry ``geometry(*inputs) -> (mu, sigma, lam, tau)`` (shapes as there), which
    with autograd is not kept for backward but recomputed there from ``inputs``: a training step then keeps the
    values and ``inputs`` only (``SSoGAttention`` passes its normalised tokens, which its value projection keeps
    anyway, and the field's parameters). ``geometry`` must be a pure differentiable function of ``inputs``.
    """
    _check_inplace("ssog_mix_steered", inplace, torch.is_grad_enabled() and values.requires_grad)
    grid = check_grid(values.shape[1], grid)[:2]
    # ``scaled`` is kept by the autograd graph until it is freed: it must not hold ``values`` (which backward frees as it
    # goes), only their sizes
    expected, width = (values.shape[0], grid[0] * grid[1]), values.shape[-1]

    def scaled(*args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mu, sigma, lam, tau = geometry(*args)
        for name, t in (("mu", mu), ("sigma", sigma), ("lam", lam)):
            if tuple(t.shape[:2]) != expected:
                raise ValueError(f"{name} must have one row per patch token, shape (B, N, ...) = {expected} + ..., "
                                 f"got {tuple(t.shape)}")
        if mu.ndim != 5 or mu.shape[-1] != 2 or sigma.shape != mu.shape or lam.shape != mu.shape[:-1]:
            raise ValueError(f"expected mu and sigma of shape (B, N, H, R, 2) and lam of shape (B, N, H, R), got "
                             f"{tuple(mu.shape)}, {tuple(sigma.shape)} and {tuple(lam.shape)}")
        if width % mu.shape[2]:
            raise ValueError(f"the values' width {width} is not divisible by the geometry's {mu.shape[2]} heads")
        tau = tau.reshape(-1).view(1, 1, -1, 1, 1)  # scalar or per head, against (B, N, H, R, 2)
        return mu, kernel_scale(sigma, tau), lam

    return torch_backend.mix_steered(
        values, grid, scaled, tuple(inputs), head_chunk=head_chunk, inplace=inplace, rows=gaussian_rows
    )
