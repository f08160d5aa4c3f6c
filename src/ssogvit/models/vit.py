"""Discrete ViT (docs/models.md): ``L`` pre-norm blocks with independent weights; timm's ViT with another mixer.

With the ``"mha"`` mixer this is timm's ViT (``vit_small_patch16_224``, ``vit_base_patch16_224``, ...): same modules,
same parameter names and counts, so a timm state dict loads unchanged.
"""

from __future__ import annotations

from ._common import VisionTransformerBase

__all__ = ["VisionTransformer"]


class VisionTransformer(VisionTransformerBase):
    """Discrete ViT: ``z <- z + Mixer(LN(z)); z <- z + MLP(LN(z))`` for each of ``depth`` blocks.

    The options are the base's (``VisionTransformerBase``): ``depth`` is the number of blocks ``L`` and
    ``drop_path_rate`` the stochastic depth rising linearly from 0 to this rate over the blocks (timm's).
    """

    family = "vit"
