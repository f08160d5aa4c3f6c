"""Patch-size and resolution transfer (docs/analysis.md, paper Table 13).

- patch-embedding kernels are resized with the FlexiViT pseudo-inverse (timm's ``resample_patch_embed``): for an
  upsampling resize ``R`` of a patch, ``<R x, w_new> = <x, w>`` exactly;
- position embeddings are resized bicubically (timm's ``resample_abs_pos_embed``);
- optionally the SSoG field is rescaled by the grid ratio, so each Gaussian covers the same image area
  (``SSoGAttention.rescale_field``, through the model's ``rescale_field``).
"""

from __future__ import annotations

import torch
from timm.layers import PatchEmbed, resample_abs_pos_embed, resample_patch_embed
from torch import Tensor, nn

__all__ = ["resize_patch_embed", "resize_pos_embed"]


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
    """Bicubic resize of the patch part of ``(1, prefix + Gh*Gw, D)`` from ``old_grid`` to ``new_grid``.

    Under ``torch.export`` (and the dynamo ONNX exporter) the resize is always in the graph, as timm does, so that a
    graph exported with a dynamic image size holds at every size: at the same grid the bicubic resize is the
    identity, exactly.
    """
    if not torch.compiler.is_exporting() and tuple(old_grid) == tuple(new_grid):
        return pos_embed
    return resample_abs_pos_embed(
        pos_embed, new_size=list(new_grid), old_size=list(old_grid), num_prefix_tokens=num_prefix_tokens
    )
