"""The SSoG operator's maths, as functions of plain tensors (docs/operator.md): parameterisation, axis kernels, the
steering geometry, and the fixed and steered mixing as a short einsum path.

This module imports no backend. ``ssogvit.ops`` checks arguments and hands the mixing to a backend
(``ssogvit.backends``), each of which computes what the einsum functions here compute; ``ssogvit.reference`` builds the
dense ``N x N`` matrix from the definitions, for tests and diagnostics. Shapes use these letters:

    B batch, H heads, R atoms, dh head width, D = H * dh,
    Gh x Gw patch grid, N = Gh * Gw patch tokens in row-major raster order, P prefix tokens.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "axis_band",
    "axis_kernels",
    "axis_rows",
    "band_halfwidth",
    "check_grid",
    "field_bands",
    "field_sigma",
    "field_tau",
    "flush_tiny",
    "flush_tiny_product",
    "functional_only",
    "gaussian_rows",
    "gaussian_rows_grad",
    "grid_offsets",
    "kernel_scale",
    "mix_fixed",
    "mix_steered",
    "output_geometry",
    "position_dtype",
    "prefix_pool",
    "steer_gate",
    "steered_geometry",
    "steering_outputs",
    "token_bands",
    "token_geometry",
]


# ---------------------------------------------------------------------------------------------------------------------
# The grid


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


def grid_offsets(length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``delta[i, j] = j - i`` over ``length`` grid positions ``(L, L)``: the exact integer offsets of source ``j`` from
    query ``i`` that every axis kernel is evaluated at (docs/operator.md, "Axis kernels")."""
    pos = torch.arange(length, device=device, dtype=dtype)
    return pos[None, :] - pos[:, None]


def position_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels are built in: at least float32, so that grid positions above 256 (bfloat16) or 2048
    (float16) stay exact integers; float64 stays float64. The tables are cast to the values' dtype afterwards."""
    return torch.promote_types(dtype, torch.float32)


def functional_only() -> bool:
    """Under ``torch.jit.trace`` or ``torch.export`` (the dynamo ONNX exporter included): the inference shortcuts that
    write into buffers (in-place ops, slice writes into views of a preallocated output) are not taken there, because
    an exported graph need not keep their aliasing (the TorchScript-based ONNX export of SSoG gave logits off by up to
    6 with them; docs/models.md), and the mixing is the einsum path of this module."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


# ---------------------------------------------------------------------------------------------------------------------
# Parameterisation (docs/operator.md, "Parameterisation", "Steering geometry")


def field_sigma(rho: Tensor, sigma_min: float, eps_sigma: float) -> Tensor:
    """Width ``sigma = sigma_min + softplus(rho) + eps_sigma``, in grid cells."""
    return sigma_min + F.softplus(rho) + eps_sigma


def field_tau(theta: Tensor, tau_min: float) -> Tensor:
    """Temperature ``tau = tau_min + softplus(theta)``."""
    return tau_min + F.softplus(theta)


def steer_gate(alpha: Tensor) -> Tensor:
    """Steering gate ``s = softplus(alpha) + 1e-4``."""
    return F.softplus(alpha) + 1e-4


def kernel_scale(sigma: Tensor, tau: Tensor) -> Tensor:
    """``s = 1 / (sigma sqrt(2 tau))``, so that a kernel's logit ``-(d - mu)^2 / (2 sigma^2 tau)`` is
    ``-((d - mu) s)^2``; in ``position_dtype`` (docs/operator.md, "Axis kernels")."""
    dtype = position_dtype(sigma.dtype)
    return torch.rsqrt(2.0 * tau.to(dtype)) / sigma.to(dtype)


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
    ``lambda_n = softmax(ell + s_lambda tanh(a_lambda))`` for token ``n``; a path without a residual keeps the fixed
    field.

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
    # (equal to rounding), and on the CPU 3x to 5x faster than across a last axis this short (docs/benchmarks-log.md,
    # "Steered SSoG against fused attention")
    return mu, sigma, torch.softmax(ell.transpose(-1, -2), dim=-2).transpose(-1, -2)


def token_geometry(tokens: Tensor, mu: Tensor, sigma: Tensor, ell: Tensor, *steering: Tensor, steer: tuple[str, ...],
                   radius: float) -> tuple[Tensor, Tensor, Tensor]:
    """``steered_geometry`` predicted from the (normalised) patch tokens by the steering maps: ``steering_outputs``
    of the maps, then ``output_geometry``.

    Args:
        tokens: ``(B, N, D)``.
        mu, sigma, ell: the fixed field ``(H, R, 2)``, ``(H, R, 2)``, ``(H, R)``.
        steering: per steered path in ``steer``'s order its raw gate ``alpha`` (scalar), then per path the map's
            weight ``(K_p, D)`` and bias ``(K_p,)``, outputs ordered ``(head, atom, axis)`` (``K_p = 2 H R`` for
            ``"mu"`` and ``"sigma"``, ``H R`` for ``"lambda"``).
        steer: the steered paths, a subset of ``("mu", "sigma", "lambda")`` in that order.
        radius: the steering radius ``M``.

    Returns:
        ``mu (B, N, H, R, 2)``, ``sigma (B, N, H, R, 2)``, ``lambda (B, N, H, R)``.
    """
    k = len(steer)
    return output_geometry(steering_outputs(tokens, *steering[k:]), mu, sigma, ell, steering[:k],
                           size=tokens.shape[:2], steer=steer, radius=radius)


def steering_outputs(tokens: Tensor, *maps: Tensor) -> tuple[Tensor, ...]:
    """The steering maps' raw outputs ``a_p = tokens W_p + b_p``, one ``(..., K_p)`` per enabled path in ``steer``'s
    order (``maps``: each path's weight, then its bias). One matmul per path: a stacked weight would be a copy that
    autograd keeps."""
    return tuple(F.linear(tokens, weight, bias) for weight, bias in zip(maps[0::2], maps[1::2]))


def output_geometry(outputs: Sequence[Tensor], mu: Tensor, sigma: Tensor, ell: Tensor, alphas: Sequence[Tensor], *,
                    size: tuple[int, int], steer: tuple[str, ...], radius: float) -> tuple[Tensor, Tensor, Tensor]:
    """``steered_geometry`` of the steering maps' raw outputs (``steering_outputs``, each ``(B, N, K_p)``) and the
    gates' raw ``alpha``, both in ``steer``'s order, for ``size = (B, N)`` tokens; the field as ``token_geometry``'s."""
    (b, n), (h, r) = size, ell.shape
    residuals = {p: a.reshape(b, n, h, r, *((2,) if p != "lambda" else ())) for p, a in zip(steer, outputs)}
    return steered_geometry(
        mu.expand(b, n, h, r, 2), sigma.expand(b, n, h, r, 2), ell.expand(b, n, h, r), residuals,
        {p: steer_gate(a) for p, a in zip(steer, alphas)}, radius=radius,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Axis kernels (docs/operator.md, "Axis kernels", "Denormals")


def flush_tiny(k: Tensor) -> Tensor:
    """Kernel entries below the dtype's smallest normal number set to exactly zero (docs/operator.md, "Denormals");
    in place in inference (no second table-sized allocation). NaN stays NaN."""
    tiny = torch.finfo(k.dtype).tiny
    if functional_only():  # the same rule in an op every exporter knows (ONNX has no threshold)
        return k.masked_fill(k <= tiny, 0.0)
    if torch.is_grad_enabled() and k.requires_grad:
        return F.threshold(k, tiny, 0.0)  # zero where k <= tiny, and no gradient there
    return F.threshold_(k, tiny, 0.0)  # one pass, in place


def flush_tiny_product(k: Tensor) -> Tensor:
    """``flush_tiny`` for a fresh product of (non-negative) kernels and mixture weights: lambda < 1 can push a normal
    tail entry below the smallest normal number again. The gradient passes through unchanged (the flushed values are
    below 1e-38, the gradient at them is not), so the result's gradients match the unflushed product's exactly."""
    if functional_only():
        return k.masked_fill(k <= torch.finfo(k.dtype).tiny, 0.0)
    if torch.is_grad_enabled() and k.requires_grad:
        return _FlushPassingGradient.apply(k)
    return F.threshold_(k, torch.finfo(k.dtype).tiny, 0.0)


class _FlushPassingGradient(torch.autograd.Function):
    """``flush_tiny`` whose gradient is the identity's (one table, and infinities flushed as in inference)."""

    @staticmethod
    def forward(ctx, k: Tensor) -> Tensor:
        return F.threshold(k, torch.finfo(k.dtype).tiny, 0.0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def gaussian_rows(delta: Tensor, mu: Tensor, scale: Tensor, *, inplace: bool | None = None) -> Tensor:
    """Kernel rows ``K[..., j] = softmax_j(-((delta_j - mu) * scale)^2)``, denormal entries set to zero: the one
    evaluation of the Gaussian kernel, for the fixed and the steered field.

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
    ``delta - mu`` (``gaussian_rows_grad``)."""

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


def gaussian_rows_grad(rows: Tensor, d: Tensor, scale: Tensor, g_rows: Tensor, *, inplace: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """Backward of ``rows = softmax_j(-(d_j s)^2)`` (``gaussian_rows``, ``d = delta - mu``; docs/operator.md,
    "Backward").

    With ``dL/dl_j = K_j (g_j - sum_i K_i g_i)`` (softmax; flushed entries are zero in ``rows`` and pass nothing) and
    ``l_j = -d_j^2 s^2``: ``dL/dmu = 2 s^2 sum_j dL/dl_j d_j`` and ``dL/ds = -2 s sum_j dL/dl_j d_j^2``.

    Args:
        rows, d, g_rows: the rows, ``delta - mu`` and ``dL/drows``, broadcast to one shape.
        scale: ``s`` with a trailing axis of size 1.
        inplace: overwrite ``g_rows`` on the way (one table less; not when a graph is being built).

    Returns:
        ``(dL/dmu, dL/ds)`` per row, with a trailing axis of size 1 (reduce them to ``mu``'s and ``s``'s shapes).
    """
    dot = (rows * g_rows).sum(-1, keepdim=True)
    if inplace:
        t = g_rows.sub_(dot).mul_(rows).mul_(d)  # dL/dl_j d_j
        g_mu = t.sum(-1, keepdim=True)
        g_s = t.mul_(d).sum(-1, keepdim=True)
    else:
        t = rows * (g_rows - dot) * d
        g_mu = t.sum(-1, keepdim=True)
        g_s = (t * d).sum(-1, keepdim=True)
    return 2.0 * scale.square() * g_mu, -2.0 * scale * g_s


def axis_kernels(length: int, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """Row-softmax Gaussian kernels along one grid axis,
    ``K[..., i, j] = softmax_j( -(j - i - mu)^2 / (2 sigma^2 tau) )`` over the ``length`` positions inside the grid.

    Args:
        length: axis length ``L`` (``Gh`` or ``Gw``).
        mu: atom centres along this axis, any shape ``S`` (e.g. ``(H, R)``), in grid cells.
        sigma: widths, shape ``S``.
        tau: temperature, broadcastable to ``S``.

    Returns:
        Kernels of shape ``S + (L, L)`` in ``position_dtype(mu.dtype)``; each row sums to 1.
    """
    scale = kernel_scale(sigma, torch.as_tensor(tau, device=mu.device))
    return axis_rows(length, mu.to(position_dtype(mu.dtype)), scale)


def axis_rows(length: int, mu: Tensor, scale: Tensor) -> Tensor:
    """``axis_kernels`` of the centres and their ``kernel_scale``, both of shape ``S`` in ``position_dtype``:
    ``S + (L, L)``."""
    delta = grid_offsets(length, mu.dtype, mu.device)  # (L, L): source j minus query i, exact integers
    return gaussian_rows(delta, mu[..., None, None], scale[..., None, None])


def band_halfwidth(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The half-width ``w`` (grid cells) of a kernel row's band: the entries farther than ``w`` from the row's centre
    (clamped to the grid) hold at most ``u = finfo(dtype).eps / 2`` of the row's mass, the unit roundoff of the
    working precision. With ``a = s^2`` and ``T = ln(2 / u)`` (docs/operator.md, "Bands", derives it):
    ``w = sqrt((T + ln(1 + 1 / (2 sqrt(a T)))) / a + 1/4)``. Float64."""
    t = math.log(4.0 / torch.finfo(dtype).eps)
    inv = 1.0 / scale.to(torch.float64)  # 1 / sqrt(a)
    return (inv * (0.5 / math.sqrt(t))).log1p_().add_(t).mul_(inv.square()).add_(0.25).sqrt_()


def axis_band(query: Tensor, mu: Tensor, scale: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """The band ``[lo, hi)`` of the kernel row of query position ``query`` (the one definition of the bands; docs/
    operator.md, "Bands"): the source positions ``j`` with ``|j - c| <= band_halfwidth(scale)``, ``c`` the centre
    ``query + mu`` clamped to the grid ``[0, length - 1]``; never empty. Outside it the row holds at most the unit
    roundoff of ``dtype`` (the values' dtype). A NaN centre or width gives the whole row, as do a width of zero
    (``scale = 0``); an infinite centre or ``scale`` gives a row of NaN in the kernels (softmax of ``-inf`` or
    ``0 * inf``), of which the band keeps at least one entry.

    Args:
        query, mu, scale: broadcastable to one shape ``S``.
        length: the axis length ``L``.
        dtype: the working precision.

    Returns:
        int32 ``S + (2,)``: ``lo`` and ``hi`` (exclusive), ``0 <= lo < hi <= L``.
    """
    w = band_halfwidth(scale, dtype)
    centre = (query + mu.to(torch.float64)).clamp_(0, length - 1)
    lo = torch.sub(centre, w).ceil_().clamp_(0, length - 1).nan_to_num_(0.0)
    hi = centre.add_(w).floor_().clamp_(0, length - 1).add_(1).nan_to_num_(length)
    return torch.stack(torch.broadcast_tensors(lo, hi), -1).to(torch.int32)


def field_bands(mu: Tensor, scale: Tensor, grid: tuple[int, int], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The fixed field's bands (``axis_band``) ``(H, R, Gh, 2)`` and ``(H, R, Gw, 2)``: of each atom's kernel row of
    each query position; ``mu``, ``scale`` ``(H, R, 2)``, axis order ``(y, x)``."""
    return tuple(axis_band(torch.arange(n, device=mu.device), mu[..., i, None], scale[..., i, None], n, dtype)
                 for i, n in enumerate(grid))


def token_bands(mu: Tensor, scale: Tensor, grid: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """The steered geometry's bands (``axis_band``) ``(B, N, H, R, 2, 2)``: per token, atom and axis ``(y, x)``, of
    the kernel row of the token's own query index (docs/operator.md, "Steered mixing"); ``mu``, ``scale``
    broadcastable to ``(B, N, H, R, 2)``."""
    (gh, gw), tokens = grid, torch.arange(grid[0] * grid[1], device=mu.device).view(-1, 1, 1)
    query = (tokens // gw, tokens % gw)
    return torch.stack([axis_band(query[i], mu[..., i], scale[..., i], n, dtype) for i, n in enumerate(grid)], -2)


def prefix_pool(patches: Tensor, num_prefix: int) -> Tensor:
    """Mixer output of the prefix tokens: the mean of the patch values ``(B, N, D)``, once per prefix token, as a
    ``(B, P, D)`` view (docs/operator.md, "Prefix tokens")."""
    return patches.mean(dim=1, keepdim=True).expand(-1, num_prefix, -1)


# ---------------------------------------------------------------------------------------------------------------------
# Mixing, the readable path (docs/operator.md, "Fixed mixing", "Steered mixing"); what every backend computes


def _with_prefix(patches: Tensor, mixed: Tensor, num_prefix: int) -> Tensor:
    return torch.cat([prefix_pool(patches, num_prefix), mixed], dim=1) if num_prefix else mixed


def mix_fixed(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor) -> Tensor:
    """Fixed mixing: prefix tokens get the mean patch value, patches
    ``Y_h[iy, ix] = sum_r lam[h, r] sum_{jy, jx} ky[h, r, iy, jy] kx[h, r, ix, jx] V_h[jy, jx]``, with ``lam``
    folded into ``ky`` and the product flushed (``flush_tiny_product``).

    Args:
        values: ``(B, P + N, D)``; ky ``(H, R, Gh, Gh)``; kx ``(H, R, Gw, Gw)``; lam ``(H, R)``.

    Returns:
        ``(B, P + N, D)``.
    """
    b, t, d = values.shape
    gh, gw = grid
    h = ky.shape[0]
    p = t - gh * gw
    kyl = flush_tiny_product(ky * lam[:, :, None, None])
    v = values[:, p:].reshape(b, gh, gw, h, d // h)
    u = torch.einsum("hrkl,bjlhd->bhrjkd", kx, v)  # x-pass, one copy per atom
    y = torch.einsum("hrij,bhrjkd->bikhd", kyl, u)  # y-pass and mixture
    return _with_prefix(values[:, p:], y.reshape(b, gh * gw, d), p)


def mix_steered(values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor) -> Tensor:
    """Steered mixing: the column pass ``U_r[iy, k] = sum_jy K^y(g_(iy,k))[r, iy, jy] V[jy, k]`` (steered by the
    token at ``(iy, k)``), the row pass ``Y[iy, ix] = sum_r lam_(iy,ix)[r] sum_k K^x(g_(iy,ix))[r, ix, k] U_r[iy, k]``
    (steered by the query), ``lam K^x`` flushed; prefix tokens get the mean patch value.

    Args:
        values: ``(B, P + N, D)``.
        mu: per-token centres ``(B, N, H, R, 2)``, axis order ``(y, x)``.
        scale: per-token ``kernel_scale``, broadcastable to ``mu``.
        lam: per-token mixture weights ``(B, N, H, R)``.

    Returns:
        ``(B, P + N, D)``.
    """
    b, t, d = values.shape
    gh, gw = grid
    h, r = mu.shape[2:4]
    p = t - gh * gw
    mu = mu.reshape(b, gh, gw, h, r, 2, 1)
    scale = scale.expand(b, gh * gw, h, r, 2).reshape(b, gh, gw, h, r, 2, 1)
    iy = torch.arange(gh, device=mu.device).view(gh, 1, 1, 1, 1)  # the query index of each token
    ix = torch.arange(gw, device=mu.device).view(1, gw, 1, 1, 1)
    delta_y = (torch.arange(gh, device=mu.device) - iy).to(scale.dtype)  # (Gh, 1, 1, 1, Gh): j - iy
    delta_x = (torch.arange(gw, device=mu.device) - ix).to(scale.dtype)  # (1, Gw, 1, 1, Gw): j - ix
    ky = gaussian_rows(delta_y, mu[..., 0, :], scale[..., 0, :])  # (B, Gh, Gw, H, R, Gh): token (iy, k)'s y-row
    w = flush_tiny_product(gaussian_rows(delta_x, mu[..., 1, :], scale[..., 1, :]) * lam[..., None].reshape(
        b, gh, gw, h, r, 1))  # (B, Gh, Gw, H, R, Gw): the query (iy, ix)'s weighted x-row
    v = values[:, p:].reshape(b, gh, gw, h, d // h)
    u = torch.einsum("bykhrj,bjkhd->bykhrd", ky.to(v.dtype), v)  # column pass
    y = torch.einsum("byxhrk,bykhrd->byxhd", w.to(v.dtype), u)  # row pass and mixture
    return _with_prefix(values[:, p:], y.reshape(b, gh * gw, d), p)
