"""Discrete ViT (docs/models.md): ``L`` pre-norm blocks with independent weights; timm's ViT with another mixer.

With the ``"mha"`` mixer this is timm's ViT (``vit_small_patch16_224``, ``vit_base_patch16_224``, ...): same modules,
same parameter names and counts, so a timm state dict loads unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssogvit.errors import InputError
from ssogvit.specs import Int, Ints
from ssogvit.layers import create_mixer

from ._common import BlockStack, VisionTransformerBase

__all__ = ["VisionTransformer"]

GLOBAL_BLOCKS = Ints(Int(0, 1023), min_len=0)


class VisionTransformer(VisionTransformerBase):
    """Discrete ViT: ``z <- z + Mixer(LN(z)); z <- z + MLP(LN(z))`` for each of ``depth`` blocks.

    The options are the base's (``VisionTransformerBase``): ``depth`` is the number of blocks ``L`` and
    ``drop_path_rate`` the stochastic depth rising linearly from 0 to this rate over the blocks (timm's). The family's
    own option:

    - ``global_blocks``: indices of blocks whose mixer is dense attention (``"mha"``) whatever the model's mixer:
      ViTDet's few global blocks among window blocks (``(2, 5, 8, 11)`` in its ViT-B), e.g.
      ``create_model("vit-base-window", global_blocks=(2, 5, 8, 11))``. Empty by default.
    """

    family = "vit"
    family_options = dict(global_blocks=())

    def _check_options(self, options: dict[str, Any], *, drop_path_rate: float) -> dict[str, Any]:
        blocks = GLOBAL_BLOCKS.check(list(options["global_blocks"]) if isinstance(options["global_blocks"], tuple)
                                     else options["global_blocks"], "global_blocks")
        if len(set(blocks)) != len(blocks):
            raise InputError(f"global_blocks={blocks}: an index appears twice", argument="global_blocks")
        return {**options, "global_blocks": sorted(blocks)}

    def _steps(self, blocks: nn.Sequential, *, drop_path_rate: float) -> nn.Module:
        indices = self.config["global_blocks"]
        if indices and max(indices) >= len(blocks):
            raise InputError(f"global_blocks={indices}: the model has {len(blocks)} blocks (indices 0 to "
                             f"{len(blocks) - 1})", argument="global_blocks")
        for i in indices:
            blocks[i].attn = create_mixer("mha", self.embed_dim, self.num_heads)
        return BlockStack(*blocks)
