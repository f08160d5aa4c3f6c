"""Looped ViT (bViT, Byra et al. 2026; SPEC section 6): one block applied ``T`` times with shared weights."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ._common import VisionTransformerBase

__all__ = ["LoopedViT"]


class LoopedViT(VisionTransformerBase):
    """Looped ViT: the discrete ViT's block, one set of weights, applied ``depth = T`` times.

    The parameter count is one block plus embeddings, final norm and head, whatever ``T``.

    Args:
        embed_dim: token width ``D``.
        num_heads: heads ``H``.
        depth: loop steps ``T``.
        mixer: mixer name from the mixer registry.
        mixer_options: keyword options passed to ``create_mixer``.
        img_size: training image size (int or ``(H, W)``).
        patch_size: square patch side.
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        num_registers: register tokens after the class token.
        global_pool: what the head reads: ``"token"`` the class token, ``"avg"`` the mean of the normalised patch
            tokens (class and register tokens excluded).
        drop_path_rate: stochastic depth of the shared block, the same at every step.
        mlp_ratio: MLP hidden width over ``D``.
        name: registry name recorded in ``config``.
    """

    family = "looped"

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
            num_registers=num_registers, global_pool=global_pool, name=name, config=config,
        )
        self.blocks = nn.ModuleList([self._make_block(mlp_ratio=mlp_ratio, drop_path=drop_path_rate)])
        self._init_weights()

    def _forward_tokens(self, z: Tensor, grid: tuple[int, int], attns: list[Tensor] | None) -> Tensor:
        block = self.blocks[0]
        for _ in range(self.depth):
            z, attn = block(z, grid, return_attn=attns is not None)
            if attns is not None:
                attns.append(attn)
        return z
