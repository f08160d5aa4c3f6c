"""Looped ViT (bViT, Byra et al. 2026; docs/models.md): one block applied ``T`` times with shared weights."""

from __future__ import annotations

from collections.abc import Iterator

from timm.layers import DropPath
from torch import Tensor, nn

from ._common import VisionTransformerBase

__all__ = ["Loop", "LoopedViT"]


class LoopedViT(VisionTransformerBase):
    """Looped ViT: the discrete ViT's block, one set of weights, applied ``depth = T`` times.

    The parameter count is one block plus embeddings, final norm and head, whatever ``T``. ``blocks`` is a ``Loop``:
    to timm's API the ``T`` iterations are the model's ``T`` blocks (an intermediate is the tokens after an iteration).
    The options are the base's (``VisionTransformerBase``); ``drop_path_rate`` is the stochastic depth of the shared
    block, the same at every step.
    """

    family = "looped"
    shared_block = True

    def _steps(self, blocks: nn.Sequential, *, drop_path_rate: float) -> Loop:
        block = blocks[0]
        if drop_path_rate > 0:  # the same rate at every step
            block.drop_path1, block.drop_path2 = DropPath(drop_path_rate), DropPath(drop_path_rate)
        return Loop(block, self.depth)


class Loop(nn.Module):
    """One block applied ``steps`` times, seen by timm as a sequence of ``steps`` blocks.

    ``loop[i]`` is the block (its ``i``-th application), ``loop[:k]`` the first ``k`` steps, iteration yields the block
    ``steps`` times: so timm's ``forward_intermediates`` returns one intermediate per iteration, its
    ``prune_intermediate_layers`` keeps the first iterations and gradient checkpointing checkpoints each iteration.
    It is called as ``loop(z, grid)``; the block is stored once (state-dict keys ``blocks.0.*``).
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

    def forward(self, z: Tensor, grid: tuple[int, int]) -> Tensor:
        for _ in range(self.steps):
            z = self.block(z, grid)
        return z

    def extra_repr(self) -> str:
        return f"steps={self.steps}"
