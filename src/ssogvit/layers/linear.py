"""``LinearAttention``: kernelised attention with the ``elu + 1`` feature map (Katharopoulos et al. 2020, "Transformers
are RNNs"); docs/models.md, "Local attention mixers"."""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from ssogvit import reference
from ssogvit.specs import DROP_RATE, EMBED_DIM, NUM_HEADS, Flag, checked
from ssogvit.layers.attention import Attention

__all__ = ["LinearAttention"]


def _phi(t: Tensor) -> Tensor:
    return F.elu(t) + 1


class LinearAttention(Attention):
    """Linear attention over all tokens, per head:

    ``y_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))``, ``phi(x) = elu(x) + 1``,

    which is ``A V`` for ``A = phi(Q) phi(K)^T`` with rows normalised (``reference.linear_attention_matrix``) but costs
    ``O(N dh^2)`` per head instead of ``O(N^2 dh)``; no ``1 / sqrt(dh)`` scale, as in the paper. Every token, prefix
    or patch, is treated alike (attention is global; ``grid`` is only checked). The sums run in at least float32 (under
    autocast too): in half precision the sum over ``N`` tokens overflows. timm's parameter names (``qkv``, ``proj``).

    Args:
        dim: token width ``D``.
        num_heads: ``H``; must divide ``dim``.
        qkv_bias: bias of the QKV projection.
        proj_bias: bias of the output projection.
        proj_drop: dropout after the output projection.
    """

    @checked
    def __init__(
        self,
        dim: Annotated[int, EMBED_DIM],
        num_heads: Annotated[int, NUM_HEADS] = 8,
        *,
        qkv_bias: Annotated[bool, Flag()] = True,
        proj_bias: Annotated[bool, Flag()] = True,
        proj_drop: Annotated[float, DROP_RATE] = 0.0,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, proj_drop=proj_drop)

    def forward(
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        """Mix tokens ``(B, T, D)``; ``grid`` and ``num_prefix_tokens`` as in ``Attention.forward``."""
        q, k, v = self._qkv(x, grid, num_prefix_tokens)  # 3 x (B, H, T, dh)
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            fq, fk, v32 = _phi(q.to(dtype)), _phi(k.to(dtype)), v.to(dtype)
            kv = fk.transpose(-2, -1) @ v32  # (B, H, dh, dh)
            norm = fq @ fk.sum(dim=-2, keepdim=True).transpose(-2, -1)  # (B, H, T, 1)
            y = (fq @ kv) / norm
        return self._output(y.to(q.dtype))

    def attention_matrix(self, x: Tensor, grid: tuple[int, int] | None = None, *,
                         num_prefix_tokens: int | None = None) -> Tensor:
        """The ``(B, H, T, T)`` matrix ``forward`` applies, built densely (diagnostics, tests)."""
        q, k, _ = self._qkv(x, grid, num_prefix_tokens)
        return reference.linear_attention_matrix(q, k)

    def flops(self, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, int]:
        """FLOPs of one image (``ssogvit.bench.flops``): projections, ``phi(K)^T V`` and ``phi(Q) (K^T V)`` (``T D dh``
        multiply-adds each) and the normaliser (``2 T D``); the feature map is not counted."""
        d, t = self.dim, grid[0] * grid[1] + num_prefix_tokens
        out = {"projections": 2 * 4 * t * d * d, "core": 2 * (2 * t * d * self.head_dim + 2 * t * d), "steering": 0}
        return out | {"total": sum(out.values())}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, feature_map=elu+1"
