"""``Attention``: the multi-head self-attention baseline (docs/operator.md), with the same call as ``SSoGAttention``."""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssogvit import ops
from ssogvit.errors import InputError
from ssogvit.specs import DROP_RATE, EMBED_DIM, NUM_HEADS, Flag, checked

__all__ = ["Attention"]


class Attention(nn.Module):
    """Standard multi-head self-attention with timm's parameter names (``qkv``, ``proj``).

    Args:
        dim: token width ``D``.
        num_heads: ``H``; must divide ``dim``.
        qkv_bias: bias of the QKV projection (on, as in ViT).
        proj_bias: bias of the output projection.
        fused: use ``F.scaled_dot_product_attention``; ``False`` runs the explicit ``softmax(QK^T/sqrt(dh)) V`` path.
        attn_drop: dropout on the attention probabilities.
        proj_drop: dropout after the output projection.
    """

    #: the classifier head that suits the mixer (a model's ``global_pool`` default): the class token, which attends to
    #: the patches by content
    default_pool: ClassVar[str] = "token"

    @checked
    def __init__(
        self,
        dim: Annotated[int, EMBED_DIM],
        num_heads: Annotated[int, NUM_HEADS] = 8,
        *,
        qkv_bias: Annotated[bool, Flag()] = True,
        proj_bias: Annotated[bool, Flag()] = True,
        fused: Annotated[bool, Flag()] = True,
        attn_drop: Annotated[float, DROP_RATE] = 0.0,
        proj_drop: Annotated[float, DROP_RATE] = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise InputError(f"dim ({dim}) must be divisible by num_heads ({num_heads})", argument="num_heads")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused = fused
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        """Attend over all tokens. ``grid`` is checked against the token count but not otherwise used.

        Args:
            x: ``(B, T, D)``.
            grid: ``(Gh, Gw)`` of the patch tokens, optional.
            num_prefix_tokens: ``P``, checked with ``grid``: ``T`` must then be ``P + Gh*Gw``; without it at most one
                prefix token is taken.
        """
        q, k, v = self._qkv(x, grid, num_prefix_tokens)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            y = self.attn_drop(self._probs(q, k)) @ v
        return self._output(y)

    def attention_matrix(self, x: Tensor, grid: tuple[int, int] | None = None, *,
                         num_prefix_tokens: int | None = None) -> Tensor:
        """The ``(B, H, T, T)`` attention probabilities for ``x`` (the explicit path; diagnostics)."""
        q, k, _ = self._qkv(x, grid, num_prefix_tokens)
        return self._probs(q, k)

    def _output(self, y: Tensor) -> Tensor:
        """Heads ``(B, H, T, dh)`` merged and projected: ``(B, T, D)``."""
        b, _, t, _ = y.shape
        return self.proj_drop(self.proj(y.transpose(1, 2).reshape(b, t, self.dim)))

    def _probs(self, q: Tensor, k: Tensor) -> Tensor:
        return torch.softmax((q * self.scale) @ k.transpose(-2, -1), dim=-1)  # (B, H, T, T)

    def _qkv(self, x: Tensor, grid: tuple[int, int] | None, num_prefix_tokens: int | None) -> tuple[Tensor, ...]:
        if x.ndim != 3:
            raise ValueError(f"Attention expects x of shape (B, T, D), got a {x.ndim}-D tensor {tuple(x.shape)}")
        if x.shape[-1] != self.dim:
            raise ValueError(f"last dimension of x is {x.shape[-1]}, expected dim={self.dim}")
        if grid is not None:
            ops.check_grid(x.shape[1], grid, num_prefix_tokens, max_implicit_prefix=1)
        b, t, _ = x.shape
        return self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, dh)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, fused={self.fused}"
