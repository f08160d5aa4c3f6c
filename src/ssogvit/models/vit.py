"""Discrete ViT (docs/models.md): ``L`` pre-norm blocks with independent weights; timm's ViT with another mixer.

With the ``"mha"`` mixer this is timm's ViT (``vit_small_patch16_224``, ``vit_base_patch16_224``, ...): same modules,
same parameter names and counts, so a timm state dict loads unchanged.
"""

from __future__ import annotations

from typing import Any

from ._common import VisionTransformerBase

__all__ = ["VisionTransformer"]


class VisionTransformer(VisionTransformerBase):
    """Discrete ViT: ``z <- z + Mixer(LN(z)); z <- z + MLP(LN(z))`` for each of ``depth`` blocks.

    Args:
        embed_dim: token width ``D``.
        num_heads: heads ``H``.
        depth: number of blocks ``L``.
        mixer: mixer name from the mixer registry.
        mixer_options: keyword options passed to ``create_mixer`` for every block.
        img_size: training image size (int or ``(H, W)``); other sizes run with a resized position embedding.
        patch_size: square patch side.
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        num_registers: register tokens after the class token.
        global_pool: what the head reads: ``"token"`` the class token, ``"avg"`` the mean of the normalised patch
            tokens (class and register tokens excluded). With SSoG only ``"avg"`` trains the last block's field.
        drop_path_rate: stochastic depth, rising linearly from 0 to this rate over the blocks (timm).
        mlp_ratio: MLP hidden width over ``D``.
        name: registry name recorded in ``config``.
    """

    family = "vit"

    def __init__(
        self,
        *,
        embed_dim: int = 768,
        num_heads: int = 12,
        depth: int = 12,
        mixer: str = "mha",
        mixer_options: dict[str, Any] | None = None,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        num_registers: int = 0,
        global_pool: str = "token",
        drop_path_rate: float = 0.0,
        mlp_ratio: float = 4.0,
        name: str | None = None,
    ) -> None:
        config = dict(
            embed_dim=embed_dim, num_heads=num_heads, depth=depth, img_size=img_size, patch_size=patch_size,
            in_chans=in_chans, num_classes=num_classes, num_registers=num_registers, global_pool=global_pool,
            drop_path_rate=drop_path_rate, mlp_ratio=mlp_ratio, **(mixer_options or {}),
        )
        super().__init__(
            embed_dim=embed_dim, num_heads=num_heads, depth=depth, mixer=mixer, mixer_options=mixer_options,
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
            num_registers=num_registers, global_pool=global_pool, drop_path_rate=drop_path_rate, mlp_ratio=mlp_ratio,
            name=name, config=config,
        )
        self._set_steps(self.blocks)  # timm's nn.Sequential of depth blocks
        self.init_weights()
