"""Put SSoG into a timm ``VisionTransformer`` that is already built (or pretrained).

    model = timm.create_model("vit_small_patch16_224", num_classes=100, dynamic_img_size=True)
    ssogvit.ssogify(model)                       # fixed SSoG, V and output projections carried over
    ssogvit.ssogify(model, mixer="ssog-steered")  # or content-steered

Every ``block.attn`` becomes an ``SSoGAttention`` (a subclass that accepts timm's call). The value rows of the old
``qkv`` projection and the output projection ``proj`` are copied over; queries and keys are dropped. The patch grid of
each forward pass is read off the patch embedding by a forward hook, so ``dynamic_img_size=True``, register tokens,
models without a class token and ``copy.deepcopy`` (EMA) all work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ssogvit.layers.ssog import STEER_PATHS, SSoGAttention

__all__ = ["ssogify", "TimmSSoGAttention"]


class _GridTracker:
    """Forward hook on timm's ``PatchEmbed`` that remembers the patch grid of the latest call."""

    def __init__(self) -> None:
        self.grid: tuple[int, int] | None = None

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if output.ndim == 4:
            fmt = str(getattr(module, "output_fmt", "NHWC"))
            self.grid = tuple(output.shape[2:4]) if fmt.endswith("NCHW") else tuple(output.shape[1:3])
        else:
            size = tuple(args[0].shape[-2:])
            if hasattr(module, "dynamic_feat_size"):
                self.grid = tuple(module.dynamic_feat_size(size))
            else:
                ph, pw = module.patch_size
                self.grid = (size[0] // ph, size[1] // pw)


class TimmSSoGAttention(SSoGAttention):
    """``SSoGAttention`` with timm's attention call ``attn(x, attn_mask=None, is_causal=False)``.

    The grid comes from the patch embedding's latest forward (see ``ssogify``) unless passed explicitly.
    """

    def __init__(self, dim: int, num_heads: int, *, grid_tracker: _GridTracker, **options: Any) -> None:
        super().__init__(dim, num_heads, **options)
        self._grid_tracker = grid_tracker

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        grid: tuple[int, int] | None = None,
    ) -> Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("SSoG mixes by relative grid position and takes no attention mask or causal flag")
        return super().forward(x, self._grid(grid))

    def attention_matrix(self, x: Tensor, grid: tuple[int, int] | None = None) -> Tensor:  # type: ignore[override]
        return super().attention_matrix(x, self._grid(grid))

    def _grid(self, grid: tuple[int, int] | None) -> tuple[int, int]:
        grid = grid if grid is not None else self._grid_tracker.grid
        if grid is None:
            raise ValueError("no patch grid recorded yet: run the timm model's forward (or pass grid=(Gh, Gw))")
        return grid


def ssogify(model: nn.Module, *, mixer: str = "ssog", copy_weights: bool = True, **options: Any) -> nn.Module:
    """Replace the attention of every block of a timm ``VisionTransformer`` by SSoG, in place.

    Args:
        model: a built timm ``VisionTransformer`` (anything with ``patch_embed`` and ``blocks[i].attn`` holding
            ``qkv`` and ``proj`` linears).
        mixer: ``"ssog"`` (fixed field) or ``"ssog-steered"`` (all three paths unless ``steer`` is given).
        copy_weights: carry the value part of ``qkv`` and the output projection over from the old attention.
        **options: ``SSoGAttention`` options (``num_atoms``, ``steer``, ``radius``, ``sigma_min``, ...).

    Returns:
        The same model, for chaining.
    """
    if mixer not in ("ssog", "ssog-steered"):
        raise ValueError(f"unknown mixer {mixer!r} for ssogify; expected 'ssog' or 'ssog-steered'")
    if mixer == "ssog-steered":
        options.setdefault("steer", STEER_PATHS)
    elif options.get("steer"):
        raise ValueError("mixer 'ssog' is the fixed field; use mixer='ssog-steered' to steer")
    if not hasattr(model, "patch_embed") or not hasattr(model, "blocks"):
        raise ValueError("ssogify expects a timm VisionTransformer (with .patch_embed and .blocks)")
    tracker = _GridTracker()
    model.patch_embed.register_forward_hook(tracker)
    replaced = 0
    for block in model.blocks:
        old = getattr(block, "attn", None)
        if old is None or not hasattr(old, "qkv") or not hasattr(old, "proj"):
            continue
        dim = old.qkv.in_features
        if old.qkv.out_features != 3 * dim or old.proj.out_features != dim:
            raise ValueError(
                f"ssogify supports attention with qkv {dim}->{3 * dim} and proj {dim}->{dim}; got qkv "
                f"{old.qkv.in_features}->{old.qkv.out_features}, proj {old.proj.in_features}->{old.proj.out_features}"
            )
        new = TimmSSoGAttention(
            dim, old.num_heads, grid_tracker=tracker, bias=old.qkv.bias is not None, **options
        ).to(device=old.qkv.weight.device, dtype=old.qkv.weight.dtype)
        if copy_weights:
            with torch.no_grad():
                new.v.weight.copy_(old.qkv.weight[2 * dim :])
                new.proj.weight.copy_(old.proj.weight)
                if old.qkv.bias is not None:
                    new.v.bias.copy_(old.qkv.bias[2 * dim :])
                if old.proj.bias is not None and new.proj.bias is not None:
                    new.proj.bias.copy_(old.proj.bias)
        block.attn = new
        replaced += 1
    if replaced == 0:
        raise ValueError("ssogify found no attention module with qkv/proj in model.blocks")
    return model
