"""Looped ViT (bViT, Byra et al. 2026; docs/models.md): one block applied ``T`` times with shared weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from timm.layers import DropPath
from torch import Tensor, nn

from ._common import VisionTransformerBase

__all__ = ["Loop", "LoopedViT"]


class LoopedViT(VisionTransformerBase):
    """Looped ViT: the discrete ViT's block, one set of weights, applied ``depth = T`` times.

    The parameter count is one block plus embeddings, final norm and head, whatever ``T``. ``blocks`` is a ``Loop``:
    to timm's API the ``T`` iterations are the model's ``T`` blocks (an intermediate is the tokens after an iteration).

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
            num_registers=num_registers, global_pool=global_pool, drop_path_rate=0.0, mlp_ratio=mlp_ratio,
            name=name, config=config, num_blocks=1,
        )
        block = self.blocks[0]
        if drop_path_rate > 0:  # the same rate at every step
            block.drop_path1, block.drop_path2 = DropPath(drop_path_rate), DropPath(drop_path_rate)
        self._set_steps(Loop(block, depth))
        self.init_weights()


class Loop(nn.Module):
    """One block applied ``steps`` times, seen by timm as a sequence of ``steps`` blocks.

    ``loop[i]`` is the block (its ``i``-th application), ``loop[:k]`` the first ``k`` steps, iteration yields the block
    ``steps`` times: so timm's ``forward_intermediates`` returns one intermediate per iteration, its
    ``prune_intermediate_layers`` keeps the first iterations and ``checkpoint_seq`` checkpoints each iteration. The
    block is stored once (state-dict keys ``blocks.0.*``).
    """

    def __init__(self, block: nn.Module, steps: int) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"a loop needs at least one step, got {steps}")
        self.add_module("0", block)
        self.steps = steps

    @property
    def block(self) -> nn.Module:
        return self._modules["0"]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[nn.Module]:
        return iter([self.block] * self.steps)

    def __getitem__(self, index: int | slice) -> nn.Module:
        if isinstance(index, slice):
            return Loop(self.block, len(range(*index.indices(self.steps))))
        if not -self.steps <= index < self.steps:
            raise IndexError(f"step {index} out of range for a loop of {self.steps} steps")
        return self.block

    def forward(self, z: Tensor) -> Tensor:
        for _ in range(self.steps):
            z = self.block(z)
        return z

    def extra_repr(self) -> str:
        return f"steps={self.steps}"
