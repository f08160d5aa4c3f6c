"""Dense reference of the SSoG operator and of the local attention baselines: the per-head mixing matrix, materialised.

Slow (``O(N^2)`` memory) and deliberately written apart from ``ssogvit.ops``: kernels come from an explicit
``exp`` / normalise, and the matrix from the definition entry by entry (Kronecker products for the fixed field, the
steered form of docs/operator.md otherwise). Every fast path is tested against it in float64; the analysis tools use it
to draw fields and measure sinks. The attention baselines' patterns (window, shifted window, neighbourhood) are boolean
``(T, T)`` masks written from their definitions in docs/models.md, and linear attention is its ``N x N`` matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dense_axis_kernel", "dense_fixed_matrix", "dense_steered_matrix", "with_prefix", "dense_mix",
           "window_mask", "neighborhood_mask", "masked_attention_matrix", "linear_attention_matrix"]


def _normalise_rows(logits: Tensor) -> Tensor:
    w = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return w / w.sum(dim=-1, keepdim=True)


def dense_axis_kernel(length: int, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """``K[..., i, j]`` proportional to ``exp(-(j - i - mu)^2 / (2 sigma^2 tau))``, rows normalised; ``S + (L, L)``."""
    i = torch.arange(length, dtype=mu.dtype, device=mu.device).view(length, 1)
    j = torch.arange(length, dtype=mu.dtype, device=mu.device).view(1, length)
    mu, sigma, tau = (t[..., None, None] for t in torch.broadcast_tensors(mu, sigma, tau))
    return _normalise_rows(-((j - i - mu) ** 2) / (2 * sigma**2 * tau))


def dense_fixed_matrix(mu: Tensor, sigma: Tensor, lam: Tensor, tau: Tensor, grid: tuple[int, int]) -> Tensor:
    """Patch-to-patch matrix of fixed SSoG, ``A[h] = sum_r lam[h, r] * kron(K^y[h, r], K^x[h, r])``.

    Args:
        mu, sigma: ``(H, R, 2)``, axis order ``(y, x)``.
        lam: ``(H, R)``.
        tau: scalar tensor or ``(H,)``.
        grid: ``(Gh, Gw)``.

    Returns:
        ``(H, N, N)`` with rows and columns in raster order.
    """
    gh, gw = grid
    h, r = lam.shape
    tau = tau.reshape(-1, 1).expand(h, r) if tau.numel() > 1 else tau.reshape(()).expand(h, r)
    ky = dense_axis_kernel(gh, mu[..., 0], sigma[..., 0], tau)  # (H, R, Gh, Gh)
    kx = dense_axis_kernel(gw, mu[..., 1], sigma[..., 1], tau)  # (H, R, Gw, Gw)
    a = torch.zeros(h, gh * gw, gh * gw, dtype=mu.dtype, device=mu.device)
    for hi in range(h):
        for ri in range(r):
            a[hi] += lam[hi, ri] * torch.kron(ky[hi, ri], kx[hi, ri])
    return a


def dense_steered_matrix(
    mu: Tensor, sigma: Tensor, lam: Tensor, tau: Tensor, grid: tuple[int, int]
) -> Tensor:
    """Patch-to-patch matrix of steered SSoG (docs/operator.md, "Steered mixing"):
    ``A[(iy,ix), (jy,k)] = sum_r lam_(iy,ix)[r] K^x(g_(iy,ix))[r, ix, k] K^y(g_(iy,k))[r, iy, jy]``.

    Args:
        mu, sigma: per-token geometry ``(B, N, H, R, 2)``.
        lam: ``(B, N, H, R)``.
        tau: scalar tensor or ``(H,)``.
        grid: ``(Gh, Gw)``.

    Returns:
        ``(B, H, N, N)``.
    """
    gh, gw = grid
    b, n, h, r, _ = mu.shape
    tau = tau.reshape(-1) if tau.numel() > 1 else tau.reshape(1).expand(h)
    tau = tau.view(1, 1, 1, h, 1, 1)
    mu = mu.view(b, gh, gw, h, r, 2, 1)
    sigma = sigma.view(b, gh, gw, h, r, 2, 1)
    # each token steers one row of each axis kernel: the row of its own query index (iy for y, ix for x)
    iy = torch.arange(gh, dtype=mu.dtype, device=mu.device).view(1, gh, 1, 1, 1, 1)
    ix = torch.arange(gw, dtype=mu.dtype, device=mu.device).view(1, 1, gw, 1, 1, 1)
    jy = torch.arange(gh, dtype=mu.dtype, device=mu.device)
    jx = torch.arange(gw, dtype=mu.dtype, device=mu.device)
    ky = _normalise_rows(-((jy - iy - mu[..., 0, :]) ** 2) / (2 * sigma[..., 0, :] ** 2 * tau))  # (B,Gh,Gw,H,R,Gh)
    kx = _normalise_rows(-((jx - ix - mu[..., 1, :]) ** 2) / (2 * sigma[..., 1, :] ** 2 * tau))  # (B,Gh,Gw,H,R,Gw)
    lam = lam.view(b, gh, gw, h, r)
    # A[b, h, (iy, ix), (jy, k)] = sum_r lam[b, iy, ix, h, r] * kx[b, iy, ix, h, r, k] * ky[b, iy, k, h, r, jy]
    a = torch.einsum("byxhr,byxhrk,bykhrj->bhyxjk", lam, kx, ky)
    return a.reshape(b, h, n, n)


def with_prefix(a: Tensor, num_prefix: int) -> Tensor:
    """Extend a patch matrix ``(..., N, N)`` to all ``P + N`` tokens: prefix rows are the uniform mean over patches,
    patch rows give prefix columns no mass (docs/operator.md, "Prefix tokens")."""
    n = a.shape[-1]
    p = num_prefix
    full = a.new_zeros(*a.shape[:-2], p + n, p + n)
    full[..., p:, p:] = a
    full[..., :p, p:] = 1.0 / n
    return full


def dense_mix(a: Tensor, values: Tensor) -> Tensor:
    """Apply per-head matrices ``(H, T, T)`` or ``(B, H, T, T)`` to values ``(B, T, D)``; returns ``(B, T, D)``."""
    b, t, d = values.shape
    h = a.shape[-3]
    v = values.reshape(b, t, h, d // h).transpose(1, 2)  # (B, H, T, dh)
    return (a @ v).transpose(1, 2).reshape(b, t, d)


def _with_global_prefix(patches: Tensor, num_prefix: int) -> Tensor:
    """A patch mask ``(N, N)`` extended to ``P + N`` tokens: prefix tokens attend to and are attended by every token."""
    n, p = patches.shape[-1], num_prefix
    full = torch.ones(p + n, p + n, dtype=torch.bool, device=patches.device)
    full[p:, p:] = patches
    return full


def window_mask(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int] = (0, 0), *,
                num_prefix: int = 0) -> Tensor:
    """Window attention's pattern ``(T, T)``: patches ``(y, x)`` and ``(y', x')`` see each other when they lie in the
    same window of a tiling of the plane by ``window`` cells whose first window starts ``shift`` cells before the
    grid, that is when ``(y + wh - sh) // wh == (y' + wh - sh) // wh`` and the same along ``x`` (Swin's shifted
    windows; ``shift = 0`` the plain non-overlapping windows, ViTDet's). Windows cut by the grid's edge are smaller."""
    (gh, gw), (wh, ww), (sh, sw) = grid, window, shift
    iy = torch.div(torch.arange(gh) + wh - sh, wh, rounding_mode="floor")
    ix = torch.div(torch.arange(gw) + ww - sw, ww, rounding_mode="floor")
    region = (iy[:, None] * (gw + ww) + ix[None, :]).reshape(-1)
    return _with_global_prefix(region[:, None] == region[None, :], num_prefix)


def neighborhood_mask(grid: tuple[int, int], kernel: tuple[int, int], *, num_prefix: int = 0) -> Tensor:
    """Neighbourhood attention's pattern ``(T, T)`` (NATTEN's definition): patch ``(y, x)`` sees the ``kh x kw`` cells
    of the window centred on it and moved inside the grid at the border, rows ``start(y) .. start(y) + kh - 1`` with
    ``start(y) = clamp(y - kh // 2, 0, Gh - kh)``, and the same along ``x``; along an axis shorter than the kernel, the
    whole axis."""
    def axis(length: int, k: int) -> Tensor:
        k = min(k, length)
        i = torch.arange(length)
        start = (i - k // 2).clamp(0, length - k)
        return (i[None, :] >= start[:, None]) & (i[None, :] < start[:, None] + k)  # (L, L): query row, key row

    my, mx = axis(grid[0], kernel[0]), axis(grid[1], kernel[1])
    patches = (my[:, None, :, None] & mx[None, :, None, :]).reshape(grid[0] * grid[1], grid[0] * grid[1])
    return _with_global_prefix(patches, num_prefix)


def masked_attention_matrix(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``softmax(q k^T * scale)`` over the keys each query may see: ``(..., T, T)`` from ``q, k (..., T, dh)``."""
    logits = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(logits.masked_fill(~mask.to(logits.device), float("-inf")), dim=-1)


def linear_attention_matrix(q: Tensor, k: Tensor) -> Tensor:
    """Linear attention's matrix (Katharopoulos et al. 2020): ``phi(q) phi(k)^T`` with ``phi = elu + 1``, rows
    normalised to sum to one; ``(..., T, T)``."""
    a = (torch.nn.functional.elu(q) + 1) @ (torch.nn.functional.elu(k) + 1).transpose(-2, -1)
    return a / a.sum(dim=-1, keepdim=True)
