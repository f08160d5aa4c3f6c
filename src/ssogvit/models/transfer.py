"""Patch-size and resolution transfer (docs/analysis.md, paper Table 13).

- patch-embedding kernels are resized with the FlexiViT pseudo-inverse (timm's ``resample_patch_embed``): for an
  upsampling resize ``R`` of a patch, ``<R x, w_new> = <x, w>`` exactly;
- position embeddings are resized bicubically (timm's ``resample_abs_pos_embed``);
- optionally the SSoG field is rescaled by the grid ratio, so each Gaussian covers the same image area.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed, resample_abs_pos_embed, resample_patch_embed
from torch import Tensor, nn

__all__ = ["resize_patch_embed", "resize_pos_embed", "rescale_field"]


def resize_patch_embed(patch_embed: PatchEmbed, patch_size: int) -> None:
    """Give ``patch_embed`` square patches of side ``patch_size`` in place, kernel resized by the pseudo-inverse."""
    new = (patch_size, patch_size)
    old = patch_embed.proj
    with torch.no_grad():
        proj = nn.Conv2d(
            old.in_channels, old.out_channels, kernel_size=new, stride=new, bias=old.bias is not None,
            device=old.weight.device, dtype=old.weight.dtype,
        )
        proj.weight.copy_(resample_patch_embed(old.weight, list(new)))
        if old.bias is not None:
            proj.bias.copy_(old.bias)
    proj.train(old.training)
    patch_embed.proj = proj
    patch_embed.patch_size = new
    sizes = patch_embed._init_img_size(patch_embed.img_size)
    patch_embed.img_size, patch_embed.grid_size, patch_embed.num_patches = sizes


def resize_pos_embed(
    pos_embed: Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int], *, num_prefix_tokens: int = 1
) -> Tensor:
    """Bicubic resize of the patch part of ``(1, prefix + Gh*Gw, D)`` from ``old_grid`` to ``new_grid``."""
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed
    return resample_abs_pos_embed(
        pos_embed, new_size=list(new_grid), old_size=list(old_grid), num_prefix_tokens=num_prefix_tokens
    )


def _inverse_softplus(y: Tensor) -> Tensor:
    # softplus^{-1}(y) = log(exp(y) - 1) = y + log(1 - exp(-y)), stable for large y.
    return y + torch.log(-torch.expm1(-y))


def rescale_field(mixer: nn.Module, factor_y: float, factor_x: float) -> None:
    """Scale an SSoG mixer's field by the grid ratio: ``mu`` and ``sigma`` per axis, the steering radius by the
    geometric mean of the two factors. Mixers without a field (MHA) are left alone.

    Uses the mixer's own ``rescale_field`` when it has one. ``sigma`` is rescaled through ``rho``
    (``sigma = sigma_min + softplus(rho) + eps_sigma``); a target width below the floor ``sigma_min + eps_sigma``
    cannot be represented and is clamped just above it.
    """
    if hasattr(mixer, "rescale_field"):
        mixer.rescale_field(factor_y, factor_x)
        return
    if not (hasattr(mixer, "mu") and hasattr(mixer, "rho")):
        return
    if not (factor_y > 0 and factor_x > 0):
        raise ValueError(f"grid ratios must be positive, got ({factor_y}, {factor_x})")
    floor = mixer.sigma_min + getattr(mixer, "eps_sigma", 1e-4)
    with torch.no_grad():
        factor = torch.tensor([factor_y, factor_x], dtype=mixer.mu.dtype, device=mixer.mu.device)
        sigma = floor + F.softplus(mixer.rho)
        target = (sigma * factor - floor).clamp_min(torch.finfo(mixer.rho.dtype).eps)
        mixer.mu.mul_(factor)
        mixer.rho.copy_(_inverse_softplus(target))
    if hasattr(mixer, "radius"):
        mixer.radius = float(mixer.radius) * math.sqrt(factor_y * factor_x)
